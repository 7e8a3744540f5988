"""The plan's save-time estimate (hpcrl/plan/savetime.py): what KillWait and a Kubernetes grace period
are compared with (issue 37 item 5, issue 39 item 3)."""

from __future__ import annotations

from hpcrl.plan.planner import plan_from_overrides
from hpcrl.plan.savetime import SAVE_OVERHEAD_S, checkpoint_gb, save_seconds, save_time
from tests.plan.test_auto_layout import GB200_SUPER


def test_save_time_is_the_checkpoint_over_the_trainer_nodes_write_rate():
    slow = plan_from_overrides([*GB200_SUPER, "cluster.checkpoint_write_gbps=0.5"])
    fast = plan_from_overrides([*GB200_SUPER, "cluster.checkpoint_write_gbps=4"])
    writers = slow.topology.train_nodes
    assert writers >= 1
    assert checkpoint_gb(slow) > 1000  # 120B params: bf16 weights, fp32 master and two Adam moments
    assert save_seconds(slow) == SAVE_OVERHEAD_S + checkpoint_gb(slow) / (0.5 * writers)
    assert save_seconds(fast) < save_seconds(slow) / 7


def test_plan_prints_the_estimate_and_refuses_a_zero_rate(cli):
    shown = cli("plan", *GB200_SUPER)
    assert shown.returncode == 0, shown.stderr
    seconds = save_time(plan_from_overrides(GB200_SUPER)).seconds
    assert f"saved in ~{seconds:.0f} s" in shown.stdout
    refused = cli("plan", *GB200_SUPER, "cluster.checkpoint_write_gbps=0")
    assert refused.returncode != 0
    assert "cluster.checkpoint_write_gbps" in refused.stderr
