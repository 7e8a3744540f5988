"""Where configuration is read from: hpcrl's ``conf/`` tree and the site's directory
(``$HPCRL_CONFIG_DIR``, default ``~/.config/hpcrl``: ``site.yaml`` and the site's own ``conf/``)."""

from __future__ import annotations

import os
from pathlib import Path

from hpcrl.errors import ConfigError


def conf_dir() -> Path:
    """The ``conf/`` tree shipped beside the package (HPCRL_CONF_DIR overrides it)."""
    override = os.environ.get("HPCRL_CONF_DIR")
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parents[2] / "conf"


def config_dir() -> Path:
    """The site's directory: ``$HPCRL_CONFIG_DIR`` or ``~/.config/hpcrl``."""
    override = os.environ.get("HPCRL_CONFIG_DIR")
    return Path(override).expanduser() if override else Path.home() / ".config" / "hpcrl"


def site_file() -> Path:
    return config_dir() / "site.yaml"


def site_conf_dir() -> Path | None:
    """The site's own config groups, when the directory exists."""
    path = config_dir() / "conf"
    return path.resolve() if path.is_dir() else None


def conf_dirs() -> tuple[Path, ...]:
    """Where config groups are searched: hpcrl's ``conf/``, then the site's. A site file may add an
    option but not replace a shipped one: which of two files won would depend on the search order."""
    site = site_conf_dir()
    if site is None:
        return (conf_dir(),)
    for path in sorted(site.rglob("*.yaml")):
        relative = path.relative_to(site)
        if (conf_dir() / relative).exists():
            raise ConfigError(
                f"{path} shadows hpcrl's own conf/{relative}; give it another name "
                "(site keys of a shipped cluster go in site.yaml)"
            )
    return (conf_dir(), site)


def group_options(group: str) -> list[str]:
    """Every option of ``group``, hpcrl's and the site's."""
    return sorted({p.stem for base in conf_dirs() for p in (base / group).glob("*.yaml")})
