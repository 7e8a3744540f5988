"""The third row of issue 33 item 3: veRL 0.9.1's PPO trainer (GRPO advantage, FSDP2 actor, vLLM colocated and
asleep while it trains, one GPU) on the job of hpcrl's ``+experiment=grpo-smollm2-1n1g-chainsum``.

    HF_HOME=... python bench/peers/verl_grpo.py [--steps 20] [--out DIR] [--legacy] [hpcrl overrides ...]
    python bench/peers/verl_grpo.py --check      # here, without a GPU: inputs, config, prompt ids, reward

As ``trl_grpo.py``, everything the job is made of comes from hpcrl's composed recipe: the model (the snapshot
``hpcrl fetch`` converted), the prompts (hpcrl's reasoning-gym generator, same seed, same training and
validation problems; written as veRL's parquet files of chat messages, few-shot turns first, which veRL
puts through the same chat template: ``--check`` asserts that veRL's prompt ids equal hpcrl's encoder's),
and the reward (``compute_score`` below: hpcrl's ``reasoning_gym`` verifier and ``reward_of``, run by
veRL's reward workers). Settings, and what cannot be matched:

| hpcrl                                   | veRL 0.9.1 (Hydra override)                                   |
|-----------------------------------------|---------------------------------------------------------------|
| algo.num_prompts_per_step, num_generations | data.train_batch_size, actor_rollout_ref.rollout.n          |
| one optimizer step a step (num_minibatches=1) | actor.ppo_mini_batch_size = prompts per step, ppo_epochs=1 |
| trainer.micro_batch_size sequences      | actor.ppo_micro_batch_size_per_gpu, log_prob_micro_batch_size_per_gpu |
| algo.lr constant, no warm-up, weight decay, betas, grad clip | actor.optim.lr, lr_scheduler_type=constant, lr_warmup_steps=0, weight_decay, betas, clip_grad / actor.grad_clip |
| algo.kl_coef=0: no reference model      | actor.use_kl_loss=False, algorithm.use_kl_in_reward=False (kl_coef>0: use_kl_loss, kl_loss_type=kl_type) |
| algo.eps_low/eps_high, no dual clip     | actor.clip_ratio_low/high; clip_ratio_c=1e4 (veRL's dual clip at 3 cannot be switched off; at 1e4 it never binds) |
| algo.loss_agg=token                     | actor.loss_agg_mode=token-mean (over the mini-batch's tokens)  |
| group mean baseline, std_normalize      | algorithm.adv_estimator=grpo, norm_adv_by_std_in_grpo         |
| rollout.max_new_tokens, data.max_prompt_tokens | data.max_response_length, data.max_prompt_length          |
| rollout.temperature, top_p, top_k       | rollout.temperature, top_p, top_k (-1 = off)                  |
| rollout.gpu_memory_utilization, max_num_seqs, prefix caching, sleep | rollout.gpu_memory_utilization, max_num_seqs, enable_prefix_caching, free_cache_engine |
| vLLM's max_num_batched_tokens default for hpcrl's LLM-class engine (16384 on an H100/H200) | rollout.max_num_batched_tokens=16384 (veRL passes 8192, the API-server default, unless told) |
| bf16 compute over fp32 weights (FSDP2 mixed precision) | actor.strategy=fsdp2, fsdp_config.model_dtype=fp32, dtype=bfloat16 |
| no activation checkpointing             | model.enable_gradient_checkpointing=False                     |
| SDPA attention, padded batches          | model.override_config.attn_implementation=sdpa, use_remove_padding=False (the device has no flash-attn; veRL's padding-free path needs its varlen kernel) |
| greedy validation, one completion, before training and every algo.val_period steps | rollout.val_kwargs (greedy, n=1), trainer.val_before_train, test_freq |

Not matched, by veRL's design: veRL recomputes the old log-probs with the actor before the update (its
``old_log_prob`` phase, a forward pass over the batch that hpcrl and TRL skip at one optimizer step a batch; its
``rollout_correction.bypass_mode`` would take vLLM's log-probs instead, which changes the ratio, so it stays off);
its rollout is vLLM's OpenAI server engine (AsyncLLM) driven by agent-loop workers, not an in-process engine;
the order in which prompts are drawn is veRL's sampler's (same problems, seed ``run.seed``, another order);
no checkpoints are written (hpcrl's are asynchronous; TRL's row writes none either).

Versions: veRL 0.9.1 pins vLLM 0.24 and transformers <5.11 for its extras; here it runs on the staged vLLM 0.26 and
the image's transformers 5.17 without a shim: every vLLM name its rollout imports or calls (the OpenAI server's
build_app/init_app_state, AsyncLLM's sleep/wake/collective_rpc/pause, the serve CLI arguments it builds) exists in
0.26 with the signature veRL probes for, and its imports pass under transformers 5.19 here; at run time on the GPU
neither pairing was tried before this script. Its wheels beyond the staged site: bench/device_runs/verl_wheels.sh.

veRL's own timing names each step's phases (``timing_s/gen``, ``reward``, ``old_log_prob``, ``ref``, ``adv``,
``update_actor``, ``update_weights``, ``step``; ``testing`` is outside ``step``). The table's columns: rollout =
gen + reward, weight sync = update_weights, train = step - rollout - weight sync (old_log_prob + adv +
update_actor). Writes ``verl_metrics.jsonl`` and prints a summary line last, in trl_grpo.py's shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **_: Any
) -> dict[str, float]:
    """veRL's reward function (``reward.custom_reward_function``), run in its reward workers: hpcrl's verifier
    and reward on the decoded completion. ``acc`` (a full score) is what veRL's validation reports."""
    from hpcrl.rewards.verifiers import Outcome, get_verifier, reward_of

    verdict = get_verifier((extra_info or {}).get("verifier", "reasoning_gym"))(solution_str, ground_truth)
    return {"score": reward_of(verdict), "acc": float(verdict.outcome is Outcome.correct)}


def build_inputs(cfg: Any, out: Path) -> tuple[Path, Path, Path, list[list[dict[str, str]]], list[Any]]:
    """The model snapshot and veRL's train/val parquet files of hpcrl's examples (chat messages: the few-shot
    turns, then the prompt, as hpcrl's encoder and trl_grpo.py build them)."""
    import pandas as pd

    from hpcrl.data.loader import load_examples
    from hpcrl.data.templates import fewshot_turns
    from hpcrl.hub.cache import hub_dir
    from hpcrl.hub.resolve import model_snapshot

    data = cfg.data
    model_dir = model_snapshot(hub_dir(cfg.cluster), cfg.model.hf_id, cfg.model.revision)
    train_ex, val_ex = load_examples(data, cfg.run.seed, hub_dir(cfg.cluster))
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    earlier = [*system, *fewshot_turns(data.fewshot, data.template)]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, examples in (("train", train_ex), ("val", val_ex)):
        rows = [
            {
                "data_source": data.source,
                "prompt": [*earlier, {"role": "user", "content": e.prompt}],
                "ability": "reasoning",
                "reward_model": {"style": "rule", "ground_truth": e.answer},
                "extra_info": {"split": name, "index": i, "verifier": data.verifier},
            }
            for i, e in enumerate(examples)
        ]
        path = out / f"{name}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        paths.append(path)
    messages = [[*earlier, {"role": "user", "content": e.prompt}] for e in train_ex[:64] + val_ex[:64]]
    return model_dir, paths[0], paths[1], messages, train_ex[:64] + val_ex[:64]


def overrides(
    cfg: Any, model_dir: Path, train: Path, val: Path, steps: int, out: Path, legacy: bool
) -> list[str]:
    """veRL's Hydra overrides for hpcrl's composed recipe (the table in the module docstring)."""
    algo, data, rollout, trainer = cfg.algo, cfg.data, cfg.rollout, cfg.trainer
    if algo.num_minibatches != 1 or algo.is_correction.value != "none" or algo.dynamic_sampling:
        raise SystemExit(
            "verl_grpo.py maps one optimizer step a batch, no IS correction, no dynamic sampling"
        )
    if algo.overlong_buffer or algo.overlong_filter or algo.max_staleness:
        raise SystemExit("verl_grpo.py maps no overlong shaping and no staleness")
    prompts, micro = algo.num_prompts_per_step, trainer.micro_batch_size
    if prompts * algo.num_generations % micro:
        raise SystemExit(
            f"{prompts * algo.num_generations} completions do not split into micro-batches of {micro}"
        )
    logprob_micro = trainer.logprob_batch_size or micro
    n_train = len(__import__("pandas").read_parquet(train))
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    kl = algo.kl_coef > 0
    return [
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.prompt_key=prompt",
        f"data.max_prompt_length={data.max_prompt_tokens}",
        f"data.max_response_length={rollout.max_new_tokens}",
        f"data.train_batch_size={prompts}",
        f"data.seed={cfg.run.seed}",
        "data.shuffle=True",
        "data.dataloader_num_workers=0",  # a few thousand short rows: worker processes only cost start-up
        "data.filter_overlong_prompts=False",  # hpcrl's generator already keeps prompts within max_prompt_tokens
        "data.truncation=error",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing="
        + str(bool(trainer.activation_checkpointing)),
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{a}.strategy=fsdp2",
        f"{a}.fsdp_config.model_dtype=fp32",
        f"{a}.fsdp_config.dtype=bfloat16",
        f"{a}.optim.lr={algo.lr}",
        f"{a}.optim.lr_scheduler_type={algo.lr_schedule.value}",
        f"{a}.optim.lr_warmup_steps={algo.lr_warmup_steps}",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.0",
        f"{a}.optim.weight_decay={trainer.weight_decay}",
        f"{a}.optim.betas=[{trainer.adamw_betas()[0]},{trainer.adamw_betas()[1]}]",
        f"{a}.optim.clip_grad={trainer.grad_clip}",
        f"{a}.grad_clip={trainer.grad_clip}",
        f"{a}.ppo_mini_batch_size={prompts}",
        f"{a}.ppo_micro_batch_size_per_gpu={micro}",
        f"{a}.ppo_epochs=1",
        f"{a}.use_dynamic_bsz=False",
        f"{a}.clip_ratio_low={algo.eps_low}",
        f"{a}.clip_ratio_high={algo.eps_high}",
        f"{a}.clip_ratio_c={algo.dual_clip or 1.0e4}",
        f"{a}.loss_agg_mode={'token-mean' if algo.loss_agg.value == 'token' else 'seq-mean-token-mean'}",
        f"{a}.entropy_coeff=0",
        f"{a}.use_kl_loss={kl}",
        f"{a}.kl_loss_coef={algo.kl_coef}",
        f"{a}.kl_loss_type={algo.kl_type.value}",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=" + str(logprob_micro),
        f"{r}.name=vllm",
        f"{r}.mode=async",
        f"{r}.n={algo.num_generations}",
        f"{r}.temperature={rollout.temperature}",
        f"{r}.top_p={rollout.top_p}",
        f"{r}.top_k={rollout.top_k or -1}",
        f"{r}.tensor_model_parallel_size={rollout.tp}",
        f"{r}.gpu_memory_utilization={rollout.gpu_memory_utilization}",
        f"{r}.max_num_seqs={rollout.max_num_seqs}",
        f"{r}.max_model_len={cfg.max_seq_len}",
        f"{r}.max_num_batched_tokens={rollout.max_num_batched_tokens or 16384}",
        f"{r}.enable_prefix_caching={rollout.enable_prefix_caching}",
        f"{r}.enforce_eager={rollout.enforce_eager}",
        f"{r}.free_cache_engine=True",
        f"{r}.dtype={rollout.dtype}",
        f"{r}.log_prob_micro_batch_size_per_gpu={logprob_micro}",
        f"{r}.calculate_log_probs={rollout.logprobs}",
        f"{r}.val_kwargs.temperature=0",
        f"{r}.val_kwargs.do_sample=False",
        f"{r}.val_kwargs.n=1",
        "algorithm.adv_estimator=grpo",
        f"algorithm.norm_adv_by_std_in_grpo={algo.std_normalize}",
        "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=[console,file]",
        "trainer.project_name=hpcrl_peers",
        f"trainer.experiment_name={cfg.run.name}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        f"trainer.total_epochs={math.ceil(steps * prompts / max(n_train, 1)) + 1}",
        f"trainer.val_before_train={algo.val_at_start}",
        f"trainer.test_freq={algo.val_period}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.use_v1={not legacy}",
        "trainer.device=cuda",
    ]


def compose_verl(ovr: list[str]) -> Any:
    """veRL's ``ppo_trainer`` config with the overrides, as ``verl.trainer.main_ppo``'s Hydra main composes it."""
    import verl.trainer.main_ppo as main_ppo
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=ovr)


def check(cfg: Any, vcfg: Any, messages: list, examples: list, model_dir: Path) -> None:
    """Without a GPU: the config resolves and passes veRL's own checks, veRL's prompt ids are hpcrl's, the
    reward function scores a right and a wrong answer."""
    import pandas as pd
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import create_rl_dataset, need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from hpcrl.run.driver import make_encoder

    OmegaConf.resolve(vcfg)
    validate_config(
        config=vcfg, use_reference_policy=need_reference_policy(vcfg), use_critic=need_critic(vcfg)
    )
    for key in ("actor_rollout_ref.rollout", "actor_rollout_ref.actor", "algorithm"):
        omega_conf_to_dataclass(OmegaConf.select(vcfg, key))  # veRL's typed configs accept the values
    assert not need_reference_policy(vcfg) and not need_critic(vcfg), (
        "kl_coef=0 GRPO has no ref model, no critic"
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    builder = create_continuous_token_builder(
        tok, hf_model_type=AutoConfig.from_pretrained(model_dir).model_type, chat_template_kwargs={}
    )
    encode, _ = make_encoder(model_dir, cfg.data)
    for msgs, e in zip(messages, examples, strict=True):
        ids, want = list(builder.build_initial_tokens(msgs)), encode(e.prompt)
        assert ids == want, (
            f"veRL's prompt ids differ from hpcrl's:\n{tok.decode(ids)!r}\n{tok.decode(want)!r}"
        )
    from hpcrl.data.procedural import decode_answer

    oracle = decode_answer(examples[0].answer)[2]["answer"]  # the task's own entry carries its answer
    right = compute_score(cfg.data.source, f"so\n<answer>{oracle}</answer>", examples[0].answer)
    wrong = compute_score(cfg.data.source, "<answer>banana</answer>", examples[0].answer)
    assert right["acc"] == 1.0 and right["score"] == 1.0 and wrong["acc"] == 0.0, (right, wrong)
    loaded = get_custom_reward_fn(vcfg)  # as veRL's reward workers load it: by file path
    assert (
        loaded is not None and loaded(cfg.data.source, "<answer>x</answer>", examples[0].answer, {}) == wrong
    )
    rows = create_rl_dataset(vcfg.data.train_files, vcfg.data, tok, None, is_train=True)
    n_train = len(pd.read_parquet(vcfg.data.train_files))
    assert len(rows) == n_train, f"veRL's dataset kept {len(rows)} of {n_train} training prompts"
    print(
        f"[verl] check: veRL's dataset reads {len(rows)} training prompts; first row keys {sorted(rows[0])}"
    )
    print(
        f"[verl] check: config resolves, {len(messages)} prompts tokenize as hpcrl's, reward {right} / {wrong}"
    )


class Watch(threading.Thread):
    """When each of veRL's metric lines appears (its file logger writes from the trainer actor), and a short
    line for each, as trl_grpo.py prints."""

    def __init__(self, path: Path, t0: float, steps: int) -> None:
        super().__init__(daemon=True)
        self.path, self.t0, self.steps, self.seen, self.stop = path, t0, steps, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.poll()
        self.poll()

    def poll(self) -> None:
        if not self.path.exists():
            return
        for line in self.path.read_text().splitlines()[len(self.seen) :]:
            try:
                rec = json.loads(line)
            except ValueError:
                return  # a line being written: next time
            self.seen.append(time.perf_counter() - self.t0)
            d = rec["data"]
            t = {k.split("/", 1)[1]: v for k, v in d.items() if k.startswith("timing_s/")}
            acc = [v for k, v in d.items() if k.startswith("val-core/") and k.endswith("/acc/mean@1")]
            print(
                f"[verl] step {rec['step']}/{self.steps} at {self.seen[-1]:.0f} s"
                + (f" | reward {d['critic/score/mean']:.3f}" if "critic/score/mean" in d else "")
                + (f" | val {acc[0]:.3f}" if acc else "")
                + (f" | {t['step']:.2f}s" if "step" in t else "")
                + "".join(
                    f" {k} {t[k]:.2f}"
                    for k in ("gen", "old_log_prob", "update_actor", "update_weights")
                    if k in t
                ),
                flush=True,
            )


def summarise(log: Path, out: Path, total: int, wall: float, seen: list[float], legacy: bool) -> None:
    rows: list[dict[str, float]] = []
    for i, line in enumerate(log.read_text().splitlines()):
        rec = json.loads(line)
        d: dict[str, Any] = rec["data"]
        row: dict[str, float] = {"step": rec["step"], "seen_s": seen[i] if i < len(seen) else float("nan")}
        row |= {f"verl/{k}": float(v) for k, v in d.items() if isinstance(v, int | float)}
        acc = [v for k, v in d.items() if k.startswith("val-core/") and k.endswith("/acc/mean@1")]
        if acc:
            row["val/accuracy"] = float(acc[0])
        t = {k[len("timing_s/") :]: float(v) for k, v in d.items() if k.startswith("timing_s/")}
        if "step" in t:
            rollout = t.get("gen", 0.0) + t.get("reward", 0.0)
            sync = t.get("update_weights", 0.0)
            row |= {"time/step": t["step"], "time/rollout": rollout, "time/weight_sync": sync}
            row["time/train"] = t["step"] - rollout - sync
            row |= {
                f"time/{k}": v for k, v in t.items() if k in ("gen", "old_log_prob", "ref", "update_actor")
            }
        if rows and rows[-1]["step"] == row["step"]:
            rows[-1] |= row  # a step's validation and its training metrics in one record
        else:
            rows.append(row)
    with open(out / "verl_metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    steps_rows = [r for r in rows if r["step"] > 0 and "time/step" in r]
    # as trl_grpo.py: step median over steps without validation, phase medians over steps 2.. (veRL's step
    # excludes its validation, ``timing_s/testing``, so a validation step is not slower; kept for equal rows)
    plain = [r["time/step"] for r in steps_rows if "val/accuracy" not in r]
    later = [r for r in steps_rows[1:] if "val/accuracy" not in r]
    phases = ("rollout", "weight_sync", "train", "gen", "old_log_prob", "ref", "update_actor")
    tokens = sum(r.get("verl/response_length/mean", 0.0) * total for r in steps_rows)
    step_sum = sum(r["time/step"] for r in steps_rows)
    print(
        json.dumps(
            {
                "peer": "verl",
                "trainer": "legacy RayPPOTrainer" if legacy else "v1 sync",
                "steps": len(steps_rows),
                "wall_s": wall,
                "first_step_at_s": steps_rows[0]["seen_s"] if steps_rows else float("nan"),
                "median_step_s": statistics.median(plain) if plain else float("nan"),
                **{
                    f"median_{k}_s": statistics.median(r[f"time/{k}"] for r in later)
                    for k in phases
                    if later and all(f"time/{k}" in r for r in later)
                },
                "gen_tokens": tokens,
                "gen_tokens_per_step_s": tokens / step_sum if step_sum else float("nan"),
                "val": [(int(r["step"]), r["val/accuracy"]) for r in rows if "val/accuracy" in r],
            }
        ),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="+experiment=grpo-smollm2-1n1g-chainsum")
    p.add_argument("--steps", type=int, default=None, help="algo.max_steps unless given")
    p.add_argument("--out", type=Path, default=Path("runs/peers/verl"))
    p.add_argument("--legacy", action="store_true", help="veRL's legacy RayPPOTrainer (trainer.use_v1=False)")
    p.add_argument("--check", action="store_true", help="inputs, config and prompt ids only; no Ray, no GPU")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from hpcrl.config.compose import compose_config
    from hpcrl.plan.planner import plan_config

    # planned as hpcrl plans it: what the config leaves to the planner (the micro-batch) as hpcrl runs it
    cfg = plan_config(compose_config([args.recipe, *args.overrides])).cfg
    steps = args.steps or cfg.algo.max_steps
    out = args.out.resolve()
    model_dir, train, val, messages, examples = build_inputs(cfg, out / "data")
    vcfg = compose_verl(overrides(cfg, model_dir, train, val, steps, out, args.legacy))
    if args.check:
        check(cfg, vcfg, messages, examples, model_dir)
        return

    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.main_ppo_v0 import TaskRunner
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    log = out / "verl_log.jsonl"
    log.unlink(missing_ok=True)
    os.environ["VERL_FILE_LOGGER_PATH"] = str(
        log
    )  # the trainer actor inherits it from this process's cluster
    auto_set_device(vcfg)
    validate_config(
        config=vcfg, use_reference_policy=need_reference_policy(vcfg), use_critic=need_critic(vcfg)
    )
    t0 = time.perf_counter()
    watch = Watch(log, t0, steps)
    watch.start()
    run_ppo(vcfg, task_runner_class=TaskRunner if args.legacy else TaskRunnerV1)
    wall = time.perf_counter() - t0
    watch.stop.set()
    watch.join()
    summarise(
        log, out, cfg.algo.num_prompts_per_step * cfg.algo.num_generations, wall, watch.seen, args.legacy
    )


if __name__ == "__main__":
    main()
