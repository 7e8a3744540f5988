"""``hpcrl init``: a starter site.yaml. On a Slurm login node it reads the GPU partitions
(``slurminfo``), proposes the catalog cluster with the same node hardware, asks for the account, the
image and the shared Hugging Face cache (or takes them from flags) and writes the keys this site needs;
without Slurm it writes a commented template. The text is built here, line by line, so that it can carry comments."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config.cluster import ClusterConfig, Scheduler, parse_slurm_time
from hpcrl.config.paths import conf_dirs, config_dir
from hpcrl.config.slurminfo import Partition
from hpcrl.errors import HpcrlError

Ask = Callable[[str, str], str]
"""(question, default) -> answer; None-interactive runs pass no Ask."""


@dataclass(frozen=True)
class Answers:
    cluster: str | None = None
    account: str | None = None
    image: str | None = None
    partition: str | None = None
    hf_home: str | None = None
    """The site's Hugging Face cache on shared storage (``env.HF_HOME``)."""


@dataclass(frozen=True)
class Match:
    cluster: str
    score: int


def catalog() -> dict[str, ClusterConfig]:
    """Every cluster option (hpcrl's and the site's), typed, read straight from its file."""
    import yaml

    from hpcrl.config.fastcompose import Unsupported, _load, build
    from hpcrl.errors import ConfigError

    out = {}
    for base in conf_dirs():
        for path in sorted((base / "cluster").glob("*.yaml")):
            try:
                out[path.stem] = build(ClusterConfig, _load(path)[1])
            except (Unsupported, yaml.YAMLError, TypeError, ValueError) as exc:
                why = " ".join(str(exc).split())
                raise ConfigError(f"{path}: {why}; fix the file or remove it") from None
    return out


def _tokens(text: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", text.lower())) - {""}


def match_clusters(part: Partition, clusters: dict[str, ClusterConfig]) -> list[Match]:
    """Catalog Slurm clusters whose nodes have the partition's GPU count and architecture, and its GPU
    model when the GRES names one (``gpu:h100:8``); best first: same model, same partition name, same
    CPU count."""
    found = []
    for name, c in clusters.items():
        if c.scheduler is not Scheduler.slurm or c.gpus_per_node != part.gpus:
            continue
        if part.arch and c.arch != part.arch:
            continue
        gpu_named = bool(part.gpu_type) and c.gpu.lower() != "cpu"
        same_gpu = gpu_named and c.gpu.lower() in _tokens(part.gpu_type)
        if gpu_named and not same_gpu:
            continue
        score = 4 * same_gpu + 2 * (c.slurm.partition == part.name) + (c.cpus_per_node == part.cpus)
        found.append(Match(name, score))
    return sorted(found, key=lambda m: (-m.score, m.cluster))


def describe(part: Partition) -> str:
    gpu = f"{part.gpus} GPU{'s' if part.gpus > 1 else ''}" + (f" ({part.gpu_type})" if part.gpu_type else "")
    limit = f"time limit {part.time_limit}" if part.time_limit else "no time limit"
    default = " (default)" if part.default else ""
    others = f"; {part.kinds - 1} other kind(s) of node left out" if part.kinds > 1 else ""
    return (
        f"partition {part.name}{default}: {part.nodes} {part.arch or '?'} nodes {part.node_names}, {gpu}, "
        f"{part.cpus} CPUs, {part.memory_mb} MB per node, {limit}{others}"
    )


def choose(
    parts: list[Partition], clusters: dict[str, ClusterConfig], answers: Answers, ask: Ask | None
) -> tuple[Partition, str]:
    """The partition and the catalog cluster to write: flags first, then the proposal (asked to confirm)."""
    if not parts:
        raise HpcrlError(
            "sinfo lists no partition with GPU nodes (GRES gpu:N); pass --cluster to write its entry"
        )
    part = next((p for p in parts if p.name == answers.partition), None) if answers.partition else parts[0]
    if part is None:
        names = ", ".join(p.name for p in parts)
        raise HpcrlError(
            f"--partition {answers.partition} is not a GPU partition here; GPU partitions: {names}"
        )
    matches = match_clusters(part, clusters)
    proposal = answers.cluster or (matches[0].cluster if matches else "")
    if ask is not None and not answers.cluster:
        listed = f" (matching: {', '.join(m.cluster for m in matches)})" if len(matches) > 1 else ""
        proposal = ask(f"catalog cluster for these nodes{listed}", proposal)
    if not proposal:
        raise HpcrlError(
            f"no catalog cluster has {part.name}'s nodes ({part.gpus} GPUs, {part.arch or '?'}"
            f"{', ' + part.gpu_type if part.gpu_type else ''}); pass --cluster NAME, or describe them in "
            f"{config_dir() / 'conf' / 'cluster'}/<name>.yaml and run `hpcrl init --cluster <name>`"
        )
    return part, known(proposal, clusters)


def fill(cluster: ClusterConfig, answers: Answers, ask: Ask | None) -> Answers:
    """Account and HF cache (always asked) and image (asked where the cluster requires one): flags win,
    empty skips. The cache question proposes this shell's ``HF_HOME``."""
    account, image, hf_home = answers.account, answers.image, answers.hf_home
    if ask is not None and account is None:
        account = ask("Slurm account (empty: none)", "")
    if ask is not None and image is None and "container.image" in cluster.slurm.required:
        image = ask("container image (squashfs path or registry image)", "")
    if ask is not None and hf_home is None:
        hf_home = ask(
            "Hugging Face cache on shared storage, HF_HOME (`hpcrl fetch` fills it; empty: none)",
            os.environ.get("HF_HOME", ""),
        )
    return Answers(answers.cluster, account or None, image or None, answers.partition, shared_dir(hf_home))


def shared_dir(path: str | None) -> str | None:
    """An absolute directory (``~`` expanded), as the job's container mounts it; None for no answer."""
    if not path:
        return None
    full = os.path.expanduser(path)
    if not os.path.isabs(full):
        raise HpcrlError(
            f"HF_HOME '{path}' is not an absolute path; give the cache's directory on shared storage "
            "(the job's container mounts it at the same path)"
        )
    return os.path.normpath(full)


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML string, quoted whatever it holds


HEADER = """\
# hpcrl site file, written by `hpcrl init` on {date}.
# Keys under clusters.<name> apply whenever a run chooses that cluster (+cluster=<name>); the command
# line wins over them. `hpcrl show +cluster=<name>` prints the result and the line each key came from.
# A cluster of your own goes in {conf}/<name>.yaml (the layout of hpcrl's conf/cluster/).
"""


def render(name: str, cluster: ClusterConfig, part: Partition | None, answers: Answers) -> str:
    """site.yaml text for catalog cluster ``name`` on partition ``part`` (None: no Slurm was read)."""
    lines = HEADER.format(date=time.strftime("%Y-%m-%d"), conf=config_dir() / "conf" / "cluster").splitlines()
    if part is not None:
        lines.append(f"# Read from sinfo/scontrol: {describe(part)}.")
    lines += ["clusters:", f"  {name}:"]
    if part is not None:
        lines.append(f"    max_nodes: {part.nodes}  # nodes of partition {part.name}")
    slurm = [f"      partition: {_q(part.name)}"] if part is not None else []
    if answers.account:
        slurm.append(f"      account: {_q(answers.account)}")
    if part is not None and part.time_limit and _minutes(part.time_limit) < cluster.slurm.time_minutes():
        slurm.append(
            f"      time: {_q(part.time_limit)}  # the partition's limit (the catalog says {cluster.slurm.time})"
        )
    lines.append("    slurm:" if slurm else "    # slurm:")
    lines += slurm
    if not answers.account:
        lines.append(_key("account", None, "<your Slurm account>", "slurm.account" in cluster.slurm.required))
    lines.append("    #   extra_sbatch: {mail_type: END, mail_user: you@example.org}  # more #SBATCH options")
    lines.append("    container:" if answers.image else "    # container:")
    needed = "container.image" in cluster.slurm.required
    lines.append(_key("image", answers.image, "<squashfs path or registry image>", needed))
    lines.append(
        '    #   mounts: ["/lustre:/lustre"]  # src:dst, the shared filesystem (the run dir and HF_HOME are added)'
    )
    if answers.hf_home:
        lines += ["    env:", f"      HF_HOME: {_q(answers.hf_home)}  # {HF_NOTE}"]
    else:
        lines += ["    # env:", f"    #   HF_HOME: /shared/hf-cache  # {HF_NOTE}"]
    return "\n".join([*lines, *OPTIONAL]) + "\n"


HF_NOTE = "the shared Hugging Face cache: `hpcrl fetch` fills it, jobs read it offline"

OPTIONAL = [
    "    # setup:  # shell lines the job script runs first; never a secret (export those in your shell)",
    "    #   - module load cuda/12.8",
    "    #   - source /shared/nccl/nccl_env.sh",
]
"""Site keys most sites need later, commented out."""


def _key(key: str, value: str | None, placeholder: str, required: bool) -> str:
    if value:
        return f"      {key}: {_q(value)}"
    note = "  # required by this cluster: fill in" if required else ""
    return f"    #   {key}: {placeholder}{note}"


def _minutes(limit: str) -> int:
    try:
        return parse_slurm_time(limit)
    except HpcrlError:
        return 10**9  # a limit we cannot read limits nothing we write


TEMPLATE = """\
# hpcrl site file (template): `hpcrl init` found no Slurm on this machine. Uncomment and fill in the
# cluster you submit to ({names}); keys under clusters.<name> apply whenever a run chooses that
# cluster, and the command line wins over them. A cluster of your own goes in {conf}/<name>.yaml.
# clusters:
#   gb200:
#     slurm: {{account: my-acc, partition: gb200nvl72, qos: normal}}  # more #SBATCH: extra_sbatch: {{...}}
#     container: {{image: /shared/images/hpcrl.sqsh, mounts: ["/lustre:/lustre"]}}
#     env: {{HF_HOME: /lustre/hf}}  # the shared Hugging Face cache (`hpcrl fetch` fills it)
#     setup: ["module load cuda/12.8"]  # shell lines the job script runs first
"""


def template(clusters: dict[str, ClusterConfig]) -> str:
    names = ", ".join(n for n, c in sorted(clusters.items()) if c.scheduler is Scheduler.slurm)
    return TEMPLATE.format(names=names, conf=config_dir() / "conf" / "cluster")


def init_from_cli(
    cluster: str | None,
    account: str | None,
    image: str | None,
    partition: str | None,
    force: bool,
    hf_home: str | None = None,
) -> int:
    """``hpcrl init``: asks what the flags leave open when stdin is a terminal, else asks nothing."""
    import sys

    def ask(question: str, default: str) -> str:
        return input(f"{question} [{default}]: ").strip() or default

    answers = Answers(cluster, account, image, partition, hf_home)
    run_init(answers, force, ask if sys.stdin.isatty() else None, print)
    return 0


def run_init(answers: Answers, force: bool, ask: Ask | None, say: Callable[[str], None]) -> Path:
    """Write the site file (``hpcrl init``); returns its path."""
    from hpcrl.config.paths import site_file
    from hpcrl.config.site import site_keys
    from hpcrl.config.slurminfo import have_slurm

    path = site_file()
    if path.exists() and not force:
        raise HpcrlError(f"{path} exists; edit it, or run `hpcrl init --force` to replace it")
    clusters = catalog()
    part: Partition | None = None
    parts = _partitions(answers, say) if have_slurm() else None
    if parts is not None:
        for found in parts:
            say(f"found   {describe(found)}")
        part, name = choose(parts, clusters, answers, ask)
        others = [m.cluster for m in match_clusters(part, clusters) if m.cluster != name]
        if others:
            say(f"also    {', '.join(others)} match these nodes (--cluster chooses)")
    elif answers.cluster:
        name = known(answers.cluster, clusters)
    else:
        _write(path, template(clusters))
        say(f"wrote   {path} (a commented template: no sinfo/scontrol on this machine)")
        return path
    filled = fill(clusters[name], answers, ask)
    _write(path, render(name, clusters[name], part, filled))
    site_keys(name)  # read back: what init writes must load
    say(f"wrote   {path} (cluster {name})")
    given = {"slurm.account": filled.account, "container.image": filled.image}
    missing = [key for key in clusters[name].slurm.required if not given.get(key)]
    if missing:
        say(f"todo    fill in {', '.join(missing)} there before submitting")
    if not filled.hf_home:
        say(
            "todo    set env.HF_HOME there: the Hugging Face cache on shared storage that `hpcrl fetch` fills"
        )
    elif not Path(filled.hf_home).is_dir():
        say(f"note    HF_HOME {filled.hf_home} does not exist yet: `hpcrl fetch` creates it")
    say(f"next    hpcrl plan +cluster={name}")
    return path


def _partitions(answers: Answers, say: Callable[[str], None]) -> list[Partition] | None:
    """The GPU partitions, or None where Slurm does not answer and --cluster says what to write."""
    from hpcrl.config.slurminfo import read_partitions

    try:
        return read_partitions()
    except HpcrlError as exc:
        if not answers.cluster:
            raise HpcrlError(f"{exc}; run `hpcrl init` on a login node, or pass --cluster") from None
        say(f"note    {exc}: writing {answers.cluster} without what Slurm says")
        return None


def known(name: str, clusters: dict[str, ClusterConfig]) -> str:
    if name not in clusters:
        raise HpcrlError(f"cluster '{name}' is not in the catalog; available: {', '.join(sorted(clusters))}")
    return name


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
