"""Cluster schema: the hardware of one node kind and the site keys needed to submit to it.

Site keys (partition, account, qos, time, container, reservation, segment, exclusive) are typed
fields; the sbatch text is built from them by ``hpcrl.launch.sbatch``, never by gluing strings. Two keys
pass site text through, checked: ``setup`` (shell lines, no secrets) and ``slurm.extra_sbatch`` (sbatch
options hpcrl does not set itself, by name from ``EXTRA_SBATCH``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hpcrl.config.kube import KubeSite
from hpcrl.config.roles import EnvNodes, JudgeNodes, RolloutNodes
from hpcrl.config.slurmtime import parse_slurm_time
from hpcrl.core.checks import MISSING, non_negative, positive
from hpcrl.errors import ConfigError


class Scheduler(StrEnum):
    local = "local"  # no Slurm: the whole loop runs on this machine
    slurm = "slurm"
    kuberay = "kuberay"  # a KubeRay RayJob on Kubernetes (cluster.kube)


@dataclass
class SlurmSite:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "04:00:00"
    """Wall-clock limit, Slurm syntax: MM, HH:MM:SS or D-HH:MM:SS."""
    reservation: str | None = None
    segment: int | None = None
    """Keep every ``segment`` nodes in one topology block (GB200 NVL72 racks); must divide the node count."""
    exclusive: bool = True
    constraint: str | None = None
    signal_delay_s: int = 120
    """Seconds between the USR2 warning and the kill: time left to write a checkpoint."""
    max_requeues: int = 3
    required: list[str] = field(default_factory=list)
    """Site keys this cluster cannot submit without, as dotted names under ``cluster.``."""
    extra_sbatch: dict[str, str] = field(default_factory=dict)
    """More ``#SBATCH`` options by Slurm's long name (``nodelist``, ``exclude``, ``dependency``,
    ``mail_type``, ``mail_user``, ``comment`` ...: ``EXTRA_SBATCH``); what hpcrl sets itself (nodes, gpus,
    time ...) has a typed key instead (``SET_BY_HPCRL``)."""

    def time_minutes(self) -> int:
        return parse_slurm_time(self.time)

    def check_extra_sbatch(self) -> None:
        for name in self.extra_sbatch:
            problem = extra_sbatch_problem(name)
            if problem:
                raise ConfigError(f"cluster.slurm.extra_sbatch.{name}: {problem}")


@dataclass
class ContainerConfig:
    image: str | None = None
    """pyxis/enroot image (a squashfs path or an image reference); None runs on the bare node."""
    mounts: list[str] = field(default_factory=list)
    """``src:dst`` bind mounts, the shared filesystem at least."""
    workdir: str | None = None


@dataclass
class ImexConfig:
    """GB200 multi-node NVLink: IMEX channel and the NCCL settings that go with it."""

    enabled: bool = False
    channel: int | None = None
    """Fixed ``/dev/nvidia-caps-imex-channels/channelN``; None lets Slurm's switch/nvidia_imex assign one."""


@dataclass
class BootstrapConfig:
    """Deadlines of the start-up inside the job (``hpcrl/launch/job.py``): a node that waits longer for
    a step fails the job with a line naming the step, so no allocation idles on a hang. Raise them on
    sites with slow shared filesystems or many nodes."""

    shared_dir_s: float = 30.0
    """How long every node waits to see node 0's file in the run directory (the shared filesystem)."""
    ray_head_s: float = 90.0
    """How long the other nodes wait for node 0 to publish the Ray head's address."""
    ray_nodes_s: float = 120.0
    """How long node 0 waits for every node and GPU of the job to join the Ray cluster."""

    def check(self) -> None:
        for key in ("shared_dir_s", "ray_head_s", "ray_nodes_s"):
            positive(f"cluster.bootstrap.{key}", getattr(self, key))


@dataclass
class ClusterConfig:
    name: str = MISSING
    scheduler: Scheduler = Scheduler.slurm
    gpu: str = MISSING
    """Accelerator model as printed in plans (GB200, B200, H200, H100, cpu)."""
    gpus_per_node: int = MISSING
    gpu_memory_gb: float = MISSING
    """Usable HBM per GPU in GB (1e9 bytes), as the vendor tools report it."""
    gpu_bf16_tflops: float = 0.0
    """Dense bf16 peak per GPU, for MFU figures."""
    host_memory_gb: float | None = None
    """Host memory per node in GB a job may use: ``hpcrl plan`` refuses a run whose offloaded optimizer
    state (``trainer.optimizer_offload``) does not fit in it. None: not checked."""
    cpus_per_node: int = 1
    arch: str = "x86_64"
    nvlink_domain_nodes: int = 1
    """Nodes in one NVLink domain (18 on a GB200 NVL72 rack)."""
    max_nodes: int | None = None
    checkpoint_write_gbps: float = 1.0
    """Sustained write rate of one node to the checkpoint filesystem, GB/s: the plan's save-time estimate,
    which a plain ``scancel``'s KillWait and a Kubernetes grace period must cover."""
    python: str | None = "python3"
    """Interpreter that runs the job on the nodes (inside the container when there is one);
    None: the interpreter running hpcrl (clusters that share this machine's filesystem and venv)."""
    slurm: SlurmSite = field(default_factory=SlurmSite)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    imex: ImexConfig = field(default_factory=ImexConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    kube: KubeSite = field(default_factory=KubeSite)
    rollout_node: RolloutNodes | None = None
    """Rollout nodes of another kind (partition, GPU, time): the job becomes a heterogeneous Slurm job."""
    judge_node: JudgeNodes | None = None
    """Judge nodes (``rewards.judge.nodes``) of another kind: a component of the heterogeneous job."""
    env_node: EnvNodes | None = None
    """Environment nodes (``env.nodes``) of another kind: a component of the heterogeneous job, no GPUs."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for every task (NCCL settings and the like). Never put secrets here."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the job script runs before hpcrl's own (``module load ...``, ``source .../nccl_env.sh``),
    on the job's first node before ``srun`` starts a task on every node: what they export reaches every
    task (and its container). A failing line ends the job. Never a secret value: export those in your shell."""

    def check(self) -> None:
        positive("cluster.gpus_per_node", self.gpus_per_node)
        positive("cluster.gpu_memory_gb", self.gpu_memory_gb)
        positive("cluster.cpus_per_node", self.cpus_per_node)
        non_negative("cluster.gpu_bf16_tflops", self.gpu_bf16_tflops)
        if self.host_memory_gb is not None:
            positive("cluster.host_memory_gb", self.host_memory_gb)
        positive("cluster.nvlink_domain_nodes", self.nvlink_domain_nodes)
        positive("cluster.checkpoint_write_gbps", self.checkpoint_write_gbps)
        if self.max_nodes is not None:
            positive("cluster.max_nodes", self.max_nodes)
        if self.slurm.segment is not None:
            positive("cluster.slurm.segment", self.slurm.segment)
        positive("cluster.slurm.signal_delay_s", self.slurm.signal_delay_s)
        non_negative("cluster.slurm.max_requeues", self.slurm.max_requeues)
        self.slurm.time_minutes()
        self.slurm.check_extra_sbatch()
        self.bootstrap.check()
        for node in (self.rollout_node, self.judge_node, self.env_node):
            if node is not None:
                node.check()
                if self.scheduler is not Scheduler.slurm:
                    raise ConfigError(
                        f"{node.KEY} describes a Slurm heterogeneous job; cluster "
                        f"'{self.name}' is {self.scheduler.value}: remove {node.KEY}"
                    )
                if isinstance(node, RolloutNodes):  # judge nodes too
                    node.check_gpu(self.gpu)
        for mount in self.container.mounts:
            if ":" not in mount:
                raise ConfigError(f"cluster.container.mounts entry '{mount}' must be 'src:dst'")
        for name in self.env:
            if looks_secret(name):
                raise ConfigError(
                    f"cluster.env.{name} looks like a secret; export it in your shell instead "
                    "(hpcrl forwards it to the job without writing it anywhere)"
                )
        for i, line in enumerate(self.setup):
            secret = secret_in_line(line)
            if secret:
                raise ConfigError(
                    f"cluster.setup[{i}] looks like it carries a secret ({secret}); remove it and export "
                    "the secret in your shell instead (sbatch forwards it to the job without writing it anywhere)"
                )
        if self.scheduler is not Scheduler.local:
            self.check_required_site_keys()
        if self.scheduler is Scheduler.kuberay:
            self.kube.check()

    def rollout_memory_gb(self, split: bool) -> float:
        """HBM per GPU the engines share: the rollout nodes' own on a split layout (``rollout_node``)."""
        node = self.rollout_node
        if split and node is not None and node.gpu_memory_gb is not None:
            return node.gpu_memory_gb
        return self.gpu_memory_gb

    def rollout_node_gpus(self) -> int | None:
        """GPUs of a dedicated rollout node where its kind has its own count (``rollout_node.gpus_per_node``);
        None: ``gpus_per_node``."""
        return None if self.rollout_node is None else self.rollout_node.gpus_per_node

    def check_required_site_keys(self) -> None:
        missing = [key for key in self.slurm.required if self.site_value(key) in (None, "", [])]
        if missing:
            from hpcrl.config.paths import site_file

            fixes = " ".join(f"cluster.{key}=<value>" for key in missing)
            raise ConfigError(
                f"cluster '{self.name}' requires {', '.join('cluster.' + k for k in missing)}; "
                f"add {fixes} to the command line, run `hpcrl init`, or add to {site_file()}: "
                f"{site_snippet(self.name, missing)}"
            )

    def site_value(self, dotted: str) -> object:
        node: object = self
        for part in dotted.split("."):
            if not hasattr(node, part):
                raise ConfigError(
                    f"cluster.slurm.required names unknown key 'cluster.{dotted}'; "
                    "use keys under cluster.slurm or cluster.container"
                )
            node = getattr(node, part)
        return node


def site_snippet(cluster: str, keys: list[str]) -> str:
    """The site.yaml entry that sets dotted ``keys`` (below ``cluster.``) for ``cluster``, with
    placeholders, as one line of YAML (flow style: the error stays one line, and it pastes as is)."""
    tree: dict[str, Any] = {}
    for key in sorted(keys):
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = f"<{leaf}>"

    def flow(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in value.items()) + "}"
        return str(value)

    return f"clusters: {{{cluster}: {flow(tree)}}}"


SECRET_PATTERN = re.compile(
    r"(TOKEN|SECRETS?|PASSWORD|PASSWD|API_?KEY|CREDENTIALS?)(_|$)|(^|_)(KEY|PAT)(_|$)|AUTH(?!OR)",
    re.IGNORECASE,
)
"""A secret's name ends a word with one of these (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY,
DB_PASSWD), has KEY or PAT as a word of its own (AWS_ACCESS_KEY_ID, SSH_PRIVATE_KEY, GITLAB_PAT), or
says AUTH anywhere but in AUTHOR (NGC_AUTH, BASIC_AUTH_USER, SSH_AUTH_SOCK); TOKENIZERS_PARALLELISM,
MAX_TOKENS, PATH, MONKEY, GIT_AUTHOR_NAME do not."""


def looks_secret(name: str) -> bool:
    return bool(SECRET_PATTERN.search(name))


_ASSIGNMENT = re.compile(r"(?:^|[\s;&|(])(?:export\s+)?([A-Za-z_]\w*)=(\S*)")
_SECRET_OPTION = re.compile(r"--?(token|password|passwd|api[-_]?key|secret)(?:=|\s+)(\S+)", re.IGNORECASE)
_TOKEN_SHAPES = re.compile(
    r"\b(hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|sk-[\w-]{20,}|AKIA[0-9A-Z]{16}"
    r"|xox[abprs]-[\w-]{10,})"
)


def secret_in_line(line: str) -> str | None:
    """What in a shell line looks like a secret value (a name or a kind, never the value itself), or None.

    A secret-looking variable may be exported by reference (``HF_TOKEN="$HF_TOKEN"``,
    ``HF_TOKEN=$(cat ~/.hf_token)``): the value stays out of the script. A literal value, a
    ``--token``/``--password`` option with one, or a string shaped like a known token is refused."""
    for name, value in _ASSIGNMENT.findall(line):
        if looks_secret(name) and value.strip("\"'") and not value.lstrip("\"'").startswith("$"):
            return f"{name}=..."
    for option, value in _SECRET_OPTION.findall(line):
        if not value.lstrip("\"'").startswith("$"):
            return f"--{option} ..."
    if _TOKEN_SHAPES.search(line):
        return "a string shaped like an access token"
    return None


EXTRA_SBATCH = (
    "acctg_freq",
    "begin",
    "bb",
    "bbf",
    "cluster_constraint",
    "comment",
    "core_spec",
    "cores_per_socket",
    "cpu_freq",
    "deadline",
    "delay_boot",
    "dependency",
    "distribution",
    "exclude",
    "extra",
    "gpu_bind",
    "gpu_freq",
    "gres_flags",
    "hint",
    "kill_on_invalid_dep",
    "licenses",
    "mail_type",
    "mail_user",
    "mcs_label",
    "mem_bind",
    "mincpus",
    "network",
    "nice",
    "nodelist",
    "ntasks_per_core",
    "ntasks_per_socket",
    "power",
    "prefer",
    "priority",
    "profile",
    "propagate",
    "sockets_per_node",
    "switches",
    "thread_spec",
    "threads_per_core",
    "tmp",
    "wait_all_nodes",
    "wckey",
)
"""sbatch options (long names, ``-`` written ``_``) that ``cluster.slurm.extra_sbatch`` passes through."""

SET_BY_HPCRL = {
    "job_name": "run.name",
    "nodes": "layout.train_nodes/layout.rollout_nodes",
    "ntasks": "layout.train_nodes/layout.rollout_nodes (one task a node)",
    "ntasks_per_node": "layout.train_nodes/layout.rollout_nodes (one task a node)",
    "gpus": "cluster.gpus_per_node",
    "gpus_per_node": "cluster.gpus_per_node",
    "gpus_per_task": "cluster.gpus_per_node",
    "gres": "cluster.gpus_per_node",
    "cpus_per_task": "cluster.cpus_per_node",
    "cpus_per_gpu": "cluster.cpus_per_node",
    "time": "cluster.slurm.time",
    "partition": "cluster.slurm.partition",
    "account": "cluster.slurm.account",
    "qos": "cluster.slurm.qos",
    "constraint": "cluster.slurm.constraint",
    "reservation": "cluster.slurm.reservation",
    "segment": "cluster.slurm.segment",
    "exclusive": "cluster.slurm.exclusive",
    "mem": "cluster.slurm.exclusive (all of each node's memory)",
    "mem_per_cpu": "cluster.slurm.exclusive (all of each node's memory)",
    "mem_per_gpu": "cluster.slurm.exclusive (all of each node's memory)",
    "signal": "cluster.slurm.signal_delay_s",
    "requeue": "cluster.slurm.max_requeues",
    "no_requeue": "cluster.slurm.max_requeues",
    "output": "run.dir (logs go to <run dir>/slurm)",
    "error": "run.dir (logs go to <run dir>/slurm)",
    "open_mode": "run.dir (logs go to <run dir>/slurm)",
}
"""sbatch options hpcrl writes itself, and the key that sets each."""


def extra_sbatch_problem(name: str) -> str | None:
    """Why ``name`` cannot be a ``cluster.slurm.extra_sbatch`` option (None: it can)."""
    option = name.replace("-", "_")
    if option in SET_BY_HPCRL:
        return f"hpcrl sets --{option.replace('_', '-')} itself; use {SET_BY_HPCRL[option]}"
    if option not in EXTRA_SBATCH:
        return f"not an sbatch option hpcrl passes through; use one of: {', '.join(EXTRA_SBATCH)}"
    return None
