"""The judge's reward without its engines: the template, the parse, the mix with the verifier's reward,
the scorer the loop talks to (over the real reward pool, the judge a plain function here: the engines
run in test_judge_slurm.py), and the config and plan refusals."""

from __future__ import annotations

import pytest

from hpcrl.config.compose import compose_config
from hpcrl.errors import ConfigError
from hpcrl.plan.planner import make_plan
from hpcrl.rewards.config import JudgeConfig, RewardsConfig
from hpcrl.rewards.judge import JudgedScorer, judge_prompt, mixed, parse_score
from hpcrl.rewards.pool import RewardPool, Task
from hpcrl.rewards.verifiers import Outcome, Verdict
from hpcrl.run.judges import gathered, judge_engine_config, spread
from hpcrl.run.timesplit import generate_seconds, scorer_stats
from tests.conftest import JOB_DOWNLOADS, SITE


def test_the_template_sees_prompt_answer_and_reference():
    task = Task(0, "7", "8", "3+5=")
    assert judge_prompt("Q:{prompt} A:{answer} R:{reference}", task) == "Q:3+5= A:7 R:8"


@pytest.mark.parametrize(
    ("reply", "how", "score"),
    [
        ("7", "number", 0.7),
        ("score: 12 of 10", "number", 1.0),  # clipped
        ("-3", "number", 0.0),
        ("2.5/10", "number", 0.25),
        ("no digits", "number", None),
        (" Yes, it is", "yes_no", 1.0),
        ("no", "yes_no", 0.0),
        ("maybe", "yes_no", None),
    ],
)
def test_a_reply_is_a_score_or_unparsable(reply, how, score):
    got = parse_score(reply, how, 10.0)
    assert got == (pytest.approx(score) if score is not None else None)


def test_the_mix_keeps_the_verifiers_outcome():
    v = mixed(Verdict(Outcome.correct), 0.5, 0.2)
    assert v.outcome is Outcome.correct and v.reward == pytest.approx(0.8 * 1.0 + 0.2 * 0.5)
    assert mixed(Verdict(Outcome.wrong), 1.0, 1.0).reward == 1.0


def test_the_scorer_judges_every_sample_in_one_batch_after_the_verifier():
    calls: list[list[str]] = []

    def judge(prompts: list[str]) -> list[str]:
        calls.append(prompts)
        return ["10" if "=8" in p else "nonsense" for p in prompts]

    settings = JudgeConfig(template="{answer}={reference}", weight=0.5)
    with RewardPool("exact", RewardsConfig(processes=2)) as pool:
        scorer = JudgedScorer(pool, judge, settings)
        scorer.submit([Task(0, "8", "8", "3+5="), Task(1, "9", "8", "3+5=")])  # as the engines finish
        scorer.submit([Task(2, "4", "4", "2+2=")])
        verdicts = scorer.drain()
        stats = scorer.stats()
    assert calls == [["8=8", "9=8", "4=4"]]  # one batch, the whole step's
    assert verdicts[0] == Verdict(Outcome.correct, 1.0)  # 0.5 * 1 + 0.5 * 1
    assert verdicts[1] == Verdict(Outcome.wrong, 0.5)  # 0.5 * 0 + 0.5 * 1 ("9=8" holds "=8")
    assert verdicts[2] == Verdict(Outcome.correct, 0.5)  # unparsable: the judge's part is 0
    assert stats["judge/samples"] == 3 and stats["judge/batches"] == 1
    assert stats["judge/parse_failures"] == 1
    assert stats["judge/mean_score"] == pytest.approx(2 / 3)
    assert stats["time/judge"] >= 0
    assert scorer.stats() == {} and scorer_stats(scorer) == {}  # reset once read
    assert scorer_stats(pool) == {}  # the pool alone has no figures of its own


def test_generation_is_the_batch_less_its_environment_and_judge_parts():
    assert generate_seconds(10.0, {"time/judge": 3.0, "time/environment": 2.0}) == 5.0
    assert generate_seconds(1.0, {"time/judge": 3.0}) == 0.0
    assert generate_seconds(4.0, {}) == 4.0


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("template", "{answer} {score}", "rewards.judge.template names 'score'"),
        ("parse", "stars", "rewards.judge.parse='stars' must be one of number, yes_no"),
        ("weight", 1.5, "rewards.judge.weight=1.5 must be in [0, 1]"),
        ("engines", 0, "rewards.judge.engines=0 must be > 0"),
        ("nodes", -1, "rewards.judge.nodes=-1 must be >= 0"),
    ],
)
def test_bad_judge_settings_are_refused_in_one_line(key, value, says):
    with pytest.raises(ConfigError) as err:
        JudgeConfig(**{key: value}).check()
    assert says in str(err.value) and "\n" not in str(err.value)


def _plan(*overrides: str):
    return make_plan(compose_config(["+experiment=grpo-tiny-1n1g-fsdp-judge", *overrides]))


def test_the_plan_sizes_the_judge_and_hpcrl_plan_shows_it(cli):
    plan = _plan()
    assert plan.judge is not None and plan.judge.gpus == 0 and plan.judge.nodes == 0
    assert plan.judge.max_model_len == 64  # the tiny model's positions
    # the CPU engine's KV: max_num_seqs sequences of 64 tokens, fp32, 2 layers x 2 KV heads x 32
    assert plan.judge.cpu_kv_gb() == pytest.approx(max(0.05, 2 * 512 * 64 * 2 * 2 * 2 * 32 * 2 / 1e9))
    out = cli("plan", "+experiment=grpo-tiny-1n1g-fsdp-judge")
    assert out.returncode == 0, out.stderr
    assert "judge: 1 x tiny (tp 1, frozen) on the run's machine" in out.stdout


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["rewards.judge.nodes=1"], "a local run has one machine, which the judges share"),
        (["rewards.judge.model=nope"], "rewards.judge.model=nope is no catalog model"),
        (["rewards.judge.max_model_len=128"], "past tiny's 64 positions"),
        (["rewards.judge.max_new_tokens=64"], "no room for a prompt"),
    ],
)
def test_judges_that_cannot_run_are_refused(overrides, says):
    with pytest.raises(ConfigError) as err:
        _plan(*overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


GPU = ["cluster=h100", *SITE, "model=qwen2_1p5b", "data=gsm8k", *JOB_DOWNLOADS]


def test_on_gpus_judges_get_nodes_of_their_own_sized_by_memory():
    with pytest.raises(ConfigError, match=r"rewards.judge.nodes=0 shares the run's GPUs.*nodes=1"):
        _plan(*GPU)
    with pytest.raises(ConfigError, match=r"9 judge engine.*need 9 GPUs; rewards.judge.nodes=1 gives 8"):
        _plan(*GPU, "rewards.judge.nodes=1", "rewards.judge.engines=9")
    plan = _plan(*GPU, "rewards.judge.nodes=2", "rewards.judge.model=qwen3_8b", "rewards.judge.tp=2")
    assert plan.judge is not None and plan.judge.gpus == 2 and plan.judge.nodes == 2
    assert plan.judge.weights_gb == pytest.approx(8.2 * 2 / 2, rel=0.05)  # bf16 over tp 2
    length = plan.cfg.max_seq_len + 512 + plan.cfg.rewards.judge.max_new_tokens  # TEMPLATE_ROOM
    assert plan.judge.max_model_len == length
    kv = plan.judge.model.kv_bytes_for_sequence(length, tp=2) / 1e9
    assert plan.judge.sequences_that_fit == int((80 * 0.8 - plan.judge.weights_gb) // kv) > 100
    with pytest.raises(ConfigError, match="cannot hold qwen3_8b's weights"):
        _plan(
            *GPU,
            "rewards.judge.nodes=1",
            "rewards.judge.model=qwen3_8b",
            "rewards.judge.gpu_memory_utilization=0.1",
        )


def test_a_batch_is_spread_over_the_judge_engines_and_gathered_in_order():
    prompts = [f"p{i}" for i in range(7)]
    shares = spread(prompts, 3)
    assert shares == [["p0", "p3", "p6"], ["p1", "p4"], ["p2", "p5"]]
    assert gathered([[p.upper() for p in share] for share in shares], 7) == [p.upper() for p in prompts]
    assert gathered([[], []], 0) == [] and spread(["a"], 2) == [["a"], []]


def test_a_judge_engine_loads_its_checkpoint_and_never_sleeps_nor_routes():
    plan = _plan()
    cfg = judge_engine_config(plan.cfg, plan.judge)
    assert cfg.rollout.backend == "vllm" and cfg.rollout.load_format == "auto"
    assert cfg.rollout.sleep is False and cfg.rollout.logprobs is False and not cfg.trainer.router_replay
    assert (cfg.rollout.max_num_seqs, cfg.rollout.max_new_tokens) == (512, 4)  # the recipe's judge keys
    assert (
        plan.cfg.rollout.max_num_seqs == 512 and plan.cfg.rollout.max_new_tokens == 8
    )  # the policy's, untouched
