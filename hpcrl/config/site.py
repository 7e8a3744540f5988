"""Site configuration: what one site adds to the catalog, read from ``$HPCRL_CONFIG_DIR``
(default ``~/.config/hpcrl``).

- ``site.yaml``: per-cluster site keys (account, partition, container, env ...) applied whenever that
  cluster is chosen, above the catalog and the recipes and below the command line::

      clusters:
        gb200:
          slurm: {account: my-acc, partition: gb200nvl72, qos: normal}
          container: {image: /shared/images/hpcrl.sqsh, mounts: ["/lustre:/lustre"]}
          env: {HF_HOME: /lustre/hf}
          setup: ["module load cuda/12.8"]

- ``conf/``: extra config groups (the site's own clusters, models, recipes) in the layout of hpcrl's
  ``conf/``, searched after it. A site file may add options but not replace a shipped one: two files
  for one option would make the result depend on search order.

Everything here is checked against the cluster schema when read: an unknown key, a value of the wrong
type, a secret-looking variable or setup line, or an sbatch option in ``slurm.extra_sbatch`` that hpcrl does
not pass through fails with the file and line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from hpcrl.config.cluster import ClusterConfig, extra_sbatch_problem, looks_secret, secret_in_line
from hpcrl.config.paths import conf_dirs, config_dir, group_options, site_file
from hpcrl.errors import ConfigError

SITE_FIELDS = ("slurm", "container", "env", "setup", "bootstrap", "imex", "python", "max_nodes")
"""What differs between two sites with the same hardware: the cluster's other fields (gpu, gpus_per_node,
memory, arch ...) describe the hardware and belong in a cluster file of the site's ``conf/cluster/``."""


@dataclass(frozen=True)
class SiteKey:
    """One leaf of site.yaml under ``clusters.<name>``: ``key`` is dotted below ``cluster.``."""

    key: str
    value: Any
    line: int

    @property
    def dotted(self) -> str:
        return f"cluster.{self.key}"


def site_keys(cluster: str) -> list[SiteKey]:
    """The site keys of ``cluster`` (an option of the cluster group); none without a site file."""
    path = site_file()
    try:
        st = path.stat()
    except OSError:
        return []
    return _read(path, st.st_mtime_ns, st.st_size).get(cluster, [])


def split_by_command_line(keys: list[SiteKey], user_keys: set[str]) -> tuple[list[SiteKey], list[SiteKey]]:
    """(applied, overridden): a site key is overridden when the command line sets it, a map or
    section holding it, or an entry under it."""

    def overridden(key: str) -> bool:
        return any(u == key or key.startswith(u + ".") or u.startswith(key + ".") for u in user_keys)

    applied = [k for k in keys if not overridden(k.dotted)]
    return applied, [k for k in keys if overridden(k.dotted)]


@cache
def _read(path: Path, mtime_ns: int, size: int) -> dict[str, list[SiteKey]]:
    """Parse and check site.yaml (cached per file version: one command may compose several times)."""
    import yaml

    from hpcrl.config.fastcompose import yaml_loader

    text = path.read_text()
    try:
        root = yaml.compose(text, Loader=yaml_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if root is None:
        return {}
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}:1: site.yaml must be a mapping with one key, clusters")
    out: dict[str, list[SiteKey]] = {}
    for key_node, value_node in root.value:
        if key_node.value != "clusters":
            raise ConfigError(
                f"{path}:{key_node.start_mark.line + 1}: unknown key '{key_node.value}'; "
                "site.yaml holds only clusters: {<cluster>: {slurm: ..., container: ..., env: ...}}"
            )
        for name_node, body in _mapping(path, value_node, "clusters"):
            _check_cluster_name(path, name_node)
            out[name_node.value] = list(_leaves(path, body, ClusterConfig, f"clusters.{name_node.value}", ""))
    return out


def _mapping(path: Path, node: Any, where: str) -> list[tuple[Any, Any]]:
    """The (key, value) nodes of a mapping; an empty entry (every key under it commented out) is one."""
    import yaml

    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
        return []
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: {where} must be a mapping")
    return list(node.value)


def _check_cluster_name(path: Path, node: Any) -> None:
    if not any((base / "cluster" / f"{node.value}.yaml").is_file() for base in conf_dirs()):
        known = group_options("cluster")
        raise ConfigError(
            f"{path}:{node.start_mark.line + 1}: clusters.{node.value} names no cluster; "
            f"available: {', '.join(known)} (a cluster of your own goes in {config_dir() / 'conf' / 'cluster'}/)"
        )


def _leaves(path: Path, node: Any, schema: type, where: str, prefix: str) -> Any:
    """Yield the SiteKeys under ``node``, checked against dataclass ``schema``."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = _hints(schema)
    for key_node, value_node in _mapping(path, node, where):
        name, line = key_node.value, key_node.start_mark.line + 1
        key = f"{prefix}{name}"
        if name not in fields or (not prefix and name not in SITE_FIELDS):
            raise ConfigError(_unknown(path, line, where, key, schema, prefix))
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            yield from _leaves(path, value_node, kind, f"{where}.{name}", f"{key}.")  # type: ignore[arg-type]
        elif key == "env":
            for var_node, val_node in _mapping(path, value_node, f"{where}.env"):
                yield _env_key(path, where, var_node, val_node)
        elif key == "slurm.extra_sbatch":  # one key, the whole map: compose's Hydra path adds no entries
            yield SiteKey(key, _extra_sbatch(path, f"{where}.extra_sbatch", value_node), line)
        else:
            if key == "setup":
                _check_setup_lines(path, f"{where}.setup", value_node)
            yield SiteKey(key, _typed(path, line, f"{where}.{name}", kind, fields[name], value_node), line)


def _unknown(path: Path, line: int, where: str, key: str, schema: type, prefix: str) -> str:
    if not prefix and key in {f.name for f in dataclasses.fields(ClusterConfig)}:
        return (
            f"{path}:{line}: {where}.{key} describes the hardware, not the site; describe a cluster of "
            f"your own in {config_dir() / 'conf' / 'cluster'}/<name>.yaml (site keys: {', '.join(SITE_FIELDS)})"
        )
    names = SITE_FIELDS if not prefix else tuple(f.name for f in dataclasses.fields(schema))
    return f"{path}:{line}: unknown key '{where}.{key.rsplit('.', 1)[-1]}'; known here: {', '.join(names)}"


def _env_key(path: Path, where: str, var_node: Any, val_node: Any) -> SiteKey:
    name, line = var_node.value, var_node.start_mark.line + 1
    if looks_secret(name):
        raise ConfigError(
            f"{path}:{line}: {where}.env.{name} looks like a secret; remove it and export it in your shell "
            "instead (hpcrl forwards it to the job without writing it anywhere)"
        )
    value = _construct(val_node)
    if not isinstance(value, str):
        raise ConfigError(f'{path}:{line}: {where}.env.{name} must be a string; quote it ({name}: "{value}")')
    return SiteKey(f"env.{name}", value, line)


def _extra_sbatch(path: Path, where: str, node: Any) -> dict[str, str]:
    """The ``slurm.extra_sbatch`` map, each option checked on its own line."""
    options = {}
    for opt_node, val_node in _mapping(path, node, where):
        name, line = opt_node.value, opt_node.start_mark.line + 1
        problem = extra_sbatch_problem(name)
        if problem:
            raise ConfigError(f"{path}:{line}: {where}.{name}: {problem}")
        value = _construct(val_node)
        if not isinstance(value, str):
            raise ConfigError(f'{path}:{line}: {where}.{name} must be a string; quote it ({name}: "{value}")')
        options[name] = value
    return options


def _check_setup_lines(path: Path, where: str, node: Any) -> None:
    """Each line of ``setup`` is written into the job script: none may carry a secret (named by the
    file and line of the entry, never by its value)."""
    import yaml

    items = node.value if isinstance(node, yaml.SequenceNode) else []
    for item in items:
        value = _construct(item)
        secret = secret_in_line(value) if isinstance(value, str) else None
        if secret:
            raise ConfigError(
                f"{path}:{item.start_mark.line + 1}: {where} line looks like it carries a secret ({secret}); "
                "remove it and export the secret in your shell instead (sbatch forwards it to the job "
                "without writing it anywhere)"
            )


def _typed(path: Path, line: int, where: str, kind: Any, field: dataclasses.Field[Any], node: Any) -> Any:
    """The YAML value of ``node`` as the schema's type; a mismatch names the file and line."""
    from hpcrl.config.fastcompose import Unsupported, convert

    value = _construct(node)
    try:
        convert(kind, value, field)
    except Unsupported:
        hint = '; quote it ("...")' if not isinstance(value, str) and "str" in str(kind) else ""
        raise ConfigError(f"{path}:{line}: {where}={value!r} is not a {_type_name(kind)}{hint}") from None
    return value


def _construct(node: Any) -> Any:
    """A node's Python value, with the composer's YAML rules (``1e-6`` is a float, as in OmegaConf)."""
    from hpcrl.config.fastcompose import yaml_loader

    loader = yaml_loader()("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _type_name(kind: Any) -> str:
    return str(kind).replace("typing.", "").replace("<class '", "").replace("'>", "")


@cache
def _hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)
