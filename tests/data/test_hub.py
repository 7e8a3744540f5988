"""``hpcrl fetch`` and offline resolution, with the real huggingface_hub against a STAND-IN hub served over
loopback HTTP (tests/harness/hub_standin.py; no machine here reaches the real hub)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.errors import ConfigError, HpcrlError
from hpcrl.hub.fetch import fetch_model, fetch_split
from hpcrl.hub.files import split_files
from hpcrl.hub.resolve import dataset_files, model_snapshot
from tests.conftest import SITE
from tests.harness.hub_standin import HubStandIn, Repo

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


def model_repo(tiny_dir: Path, big_shard: bytes = b"") -> Repo:
    """The tiny model's real files, plus what a publisher ships that hpcrl must not fetch."""
    files = {p.name: p.read_bytes() for p in tiny_dir.iterdir() if p.is_file()}
    files |= {"pytorch_model.bin": b"\0" * 4096, "original/consolidated.00.pth": b"\1" * 4096}
    if big_shard:  # a second shard named by an index, large enough to be downloaded in chunks
        files["extra-00002.safetensors"] = big_shard
        index = {"weight_map": {"a": "model.safetensors", "b": "extra-00002.safetensors"}}
        files["model.safetensors.index.json"] = json.dumps(index).encode()
        files["consolidated.safetensors"] = b"\2" * 4096  # the publisher's own copy, not in the index
    return Repo(files)


DATA_CARD = b"""---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# A data set
"""


def data_repo() -> Repo:
    """GSM8K's layout: two subsets, each split a Parquet file (``datasets``' own format on the hub)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    def rows(n: int, tag: str) -> bytes:
        table = pa.Table.from_pylist(
            [{"question": f"{tag} {i}+1?", "answer": f"#### {i + 1}"} for i in range(n)]
        )
        out = io.BytesIO()
        pq.write_table(table, out)
        return out.getvalue()

    files = {
        "README.md": DATA_CARD,
        "main/train-00000-of-00001.parquet": rows(8, "main-train"),
        "main/test-00000-of-00001.parquet": rows(3, "main-test"),
        "socratic/train-00000-of-00001.parquet": rows(5, "socratic"),
    }
    return Repo(files, kind="dataset")


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return tmp_path / "hf" / "hub"


def standin(repos: dict[str, Repo], monkeypatch, **kw) -> HubStandIn:
    hub = HubStandIn(repos, **kw).__enter__()
    import huggingface_hub.constants as constants

    # huggingface_hub reads HF_ENDPOINT at import: set both the variable and its constant
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    return hub


def test_fetch_takes_the_model_files_only_and_the_job_resolves_them_offline(tiny_dir, hub_env, monkeypatch):
    hub = standin({"org/tiny-math": model_repo(tiny_dir)}, monkeypatch)
    lines: list[str] = []
    try:
        got = fetch_model(hub_env, "org/tiny-math", None, lines.append)
        again = fetch_model(hub_env, "org/tiny-math", None, lines.append)
    finally:
        hub.__exit__()
    assert got.fetched == got.files and again.fetched == 0, lines
    assert "already there" in again.line() and got.commit[:12] in again.line()
    gets = [path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path]
    assert not any(p.endswith((".bin", ".pth")) or "/original/" in p for p in gets), gets
    # offline (the stand-in is down): the same commit's directory, loadable by transformers
    path = model_snapshot(hub_env, "org/tiny-math", None)
    assert (
        path.name == got.commit
        and (path / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    )
    assert not (path / "pytorch_model.bin").exists() and not (path / "original").exists()
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(path).model_type == "qwen2"
    assert AutoTokenizer.from_pretrained(path)("1+1")["input_ids"]
    assert model_snapshot(hub_env, "org/tiny-math", got.commit) == path  # a pinned commit resolves too
    with pytest.raises(
        ConfigError,
        match=r"model\.hf_id=org/tiny-math \(revision v2\) is not in the Hugging Face cache .* run `hpcrl fetch`",
    ):
        model_snapshot(hub_env, "org/tiny-math", "v2")


def test_a_broken_transfer_resumes_where_it_stopped_and_an_interrupted_fetch_keeps_what_finished(
    tiny_dir, hub_env, monkeypatch
):
    """huggingface_hub retries a broken body from the last whole 10 MiB chunk (a Range request); a fetch
    that dies keeps the files it finished and never leaves a partial file where the job would read it."""
    shard = os.urandom(12 * MIB)
    repo = model_repo(tiny_dir, big_shard=shard)
    hub = standin({"org/tiny-math": repo}, monkeypatch, cut_after={"extra-00002.safetensors": 11 * MIB})
    try:
        fetch_model(hub_env, "org/tiny-math", None, lambda _: None)
    finally:
        hub.__exit__()
    assert not any(p.endswith("consolidated.safetensors") for _, p, _ in hub.requests)
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("extra-00002.safetensors")]
    assert ranges == ["", f"bytes={10 * MIB}-"], ranges
    path = model_snapshot(hub_env, "org/tiny-math", None)
    assert (path / "extra-00002.safetensors").read_bytes() == shard

    # a second cache: the shard's transfer fails for good (the fetch stops), the rest is kept
    cache2 = hub_env.parent.parent / "hf2" / "hub"
    failing = HubStandIn({"org/tiny-math": repo}).__enter__()
    monkeypatch.setenv("HF_ENDPOINT", failing.url)
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "ENDPOINT", failing.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", failing.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    failing.cut_after = _AlwaysCut("extra-00002.safetensors", 1000)
    try:
        with pytest.raises(HpcrlError):
            fetch_model(cache2, "org/tiny-math", None, lambda _: None)
        # the ref is written once the snapshot is complete: a job never resolves a partial one
        with pytest.raises(ConfigError, match=r"\(revision main\) is not in the Hugging Face cache"):
            model_snapshot(cache2, "org/tiny-math", None)
        commit = next((cache2 / "models--org--tiny-math" / "snapshots").iterdir()).name
        with pytest.raises(ConfigError, match=r"incomplete in the cache .*extra-00002\.safetensors missing"):
            model_snapshot(cache2, "org/tiny-math", commit)
        failing.cut_after = {}
        failing.requests.clear()
        done = fetch_model(cache2, "org/tiny-math", None, lambda _: None)
    finally:
        failing.__exit__()
    gets = [p.rsplit("/", 1)[-1] for m, p, _ in failing.requests if m == "GET" and "/resolve/" in p]
    assert gets == ["extra-00002.safetensors"] and done.fetched == 1, gets
    assert (model_snapshot(cache2, "org/tiny-math", None) / "extra-00002.safetensors").read_bytes() == shard


class _AlwaysCut(dict):
    """A cut that is never forgotten: every GET of the file breaks off."""

    def __init__(self, name: str, after: int) -> None:
        super().__init__({name: after})
        self._name, self._after = name, after

    def pop(self, key, default=None):  # type: ignore[override]
        return self._after if key == self._name else default


def test_gated_model_needs_hf_token_which_is_never_written(tiny_dir, hub_env, monkeypatch, tmp_path):
    repo = model_repo(tiny_dir)
    repo.gated, repo.token = True, "hf_secret_standin_0123456789"
    hub = standin({"org/gated": repo}, monkeypatch)
    try:
        with pytest.raises(ConfigError, match=r"model\.hf_id=org/gated is gated: .*export HF_TOKEN"):
            fetch_model(hub_env, "org/gated", None, lambda _: None)
        monkeypatch.setenv("HF_TOKEN", repo.token)
        fetch_model(hub_env, "org/gated", None, lambda _: None)
    finally:
        hub.__exit__()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and repo.token.encode() in p.read_bytes()]
    assert written == []


def test_data_set_splits_by_their_card_fetched_and_read_offline(hub_env, monkeypatch):
    hub = standin({"org/gsm": data_repo()}, monkeypatch)
    try:
        train = fetch_split(hub_env, "hf:org/gsm:main", "train", "data.source", lambda _: None)
        fetch_split(hub_env, "hf:org/gsm:main", "test", "data.val_source", lambda _: None)
    finally:
        hub.__exit__()
    assert train.files == 2  # the split's file and the card
    files = dataset_files(hub_env, "hf:org/gsm:main", "train")
    assert [f.name for f in files] == ["train-00000-of-00001.parquet"] and files[0].parent.name == "main"
    assert not (files[0].parents[1] / "socratic").exists()  # another subset is not fetched
    from hpcrl.data.loader import read_records

    records = read_records("hf:org/gsm:main", "test", hub_env)
    assert [r["question"] for r in records] == ["main-test 0+1?", "main-test 1+1?", "main-test 2+1?"]
    with pytest.raises(ConfigError, match=r"data\.source=hf:org/gsm:socratic split 'train' is incomplete"):
        dataset_files(hub_env, "hf:org/gsm:socratic", "train")
    with pytest.raises(ConfigError, match=r"has subsets main, socratic: name one as hf:<repo>:<subset>"):
        dataset_files(hub_env, "hf:org/gsm", "train")


@pytest.mark.parametrize(
    ("paths", "split", "want"),
    [
        (["data/dapo-math-17k.parquet", "README.md"], "train", ["data/dapo-math-17k.parquet"]),
        (["test.jsonl", "README.md"], "test", ["test.jsonl"]),
        (
            ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test-0.parquet"],
            "train",
            ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"],
        ),
        (["validation/part-0.jsonl", "train/part-0.jsonl"], "validation", ["validation/part-0.jsonl"]),
        (
            ["data/train_1M-00000.parquet", "data/train-00000.parquet"],
            "train_1M",
            ["data/train_1M-00000.parquet"],
        ),
    ],
)
def test_split_files_by_name_as_datasets_infers_them(paths, split, want):
    assert split_files(paths, split, None, None) == want


def test_submit_refuses_what_the_cache_lacks_before_writing_anything(
    tiny_dir, hub_env, monkeypatch, tmp_path
):
    hub = standin({"org/tiny-math": model_repo(tiny_dir), "org/gsm": data_repo()}, monkeypatch)
    try:
        fetch_model(hub_env, "org/tiny-math", None, lambda _: None)
    finally:
        hub.__exit__()
    env = {**os.environ, "HF_HOME": str(hub_env.parent), "HF_HUB_OFFLINE": "1"}
    base = ["submit", "model.hf_id=org/tiny-math", f"run.output_root={tmp_path / 'runs'}"]

    def submit(*extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "hpcrl.cli", *base, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)

    lacking = submit("model.hf_id=org/other")
    assert lacking.returncode == 2
    assert lacking.stderr.strip().splitlines() == [
        f"hpcrl: error: model.hf_id=org/other (revision main) is not in the Hugging Face cache {hub_env}: "
        "run `hpcrl fetch` with this command's overrides on a login node (it fills the cache)"
    ]
    data = submit("data.source=hf:org/gsm:main", "data.prompt_field=question")
    assert (
        data.returncode == 2 and "data.source=hf:org/gsm:main is not in the Hugging Face cache" in data.stderr
    )
    # a shard named by the index that is missing: the snapshot is incomplete
    snap = model_snapshot(hub_env, "org/tiny-math", None)
    index = {"weight_map": {"a": "model.safetensors", "b": "model-00002.safetensors"}}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    partial = submit()
    assert partial.returncode == 2 and "incomplete in the cache" in partial.stderr
    assert "model-00002.safetensors missing" in partial.stderr
    assert not (tmp_path / "runs").exists()  # refused before any run directory was written
    local = submit("model.hf_id=./no/such/dir")
    assert local.returncode == 2 and "model.hf_id=./no/such/dir is neither a model directory" in local.stderr


def test_doctor_checks_the_model_snapshot_and_data_files_the_job_reads(tiny_dir, hub_env, monkeypatch):
    from hpcrl.launch.doctor import check_paths, expect_from_plan
    from tests.conftest import plan

    hub = standin({"org/tiny-math": model_repo(tiny_dir), "org/gsm": data_repo()}, monkeypatch)
    try:
        fetch_model(hub_env, "org/tiny-math", None, lambda _: None)
        fetch_split(hub_env, "hf:org/gsm:main", "train", "data.source", lambda _: None)
    finally:
        hub.__exit__()
    monkeypatch.setenv("HF_HOME", str(hub_env.parent))
    overrides = ["model.hf_id=org/tiny-math", "data.source=hf:org/gsm:main", "data.prompt_field=question"]
    expect = expect_from_plan(plan(*overrides))
    snapshot = model_snapshot(hub_env, "org/tiny-math", None)
    data = dataset_files(hub_env, "hf:org/gsm:main", "train")[0]
    assert expect.paths == {
        "HF_HOME": str(hub_env.parent),
        "model": str(snapshot / "config.json"),
        "data.source[0]": str(data),
    }
    assert check_paths(expect).ok
    data.resolve().unlink()  # the blob behind the snapshot's link: what an unmounted cache looks like
    result = check_paths(expect)
    assert not result.ok and f"data.source[0]={data}" in result.detail, result


def test_plan_refuses_what_the_cache_lacks_after_its_tables(cli, tmp_path):
    result = cli("plan", "+cluster=gb200", "+model=nemotron_super", *SITE, f"+cluster.env.HF_HOME={tmp_path}")
    assert result.returncode == 2 and "Memory per GPU" in result.stdout, result.stderr
    assert result.stderr.startswith(
        "hpcrl: error: model.hf_id=nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-Base-BF16 (revision main) is not "
        f"in the Hugging Face cache {tmp_path / 'hub'}: run `hpcrl fetch`"
    )


def test_submit_pins_the_commit_it_checked_and_makes_paths_absolute(tiny_dir, hub_env, monkeypatch, tmp_path):
    from hpcrl.hub.check import pin_inputs
    from tests.conftest import compose

    hub = standin({"org/tiny-math": model_repo(tiny_dir)}, monkeypatch)
    try:
        got = fetch_model(hub_env, "org/tiny-math", None, lambda _: None)
    finally:
        hub.__exit__()
    monkeypatch.setenv("HF_HOME", str(hub_env.parent))
    monkeypatch.chdir(tmp_path)
    cfg = compose("model.hf_id=org/tiny-math", "checkpoint.dir=rel/ckpt")
    pin_inputs(cfg)
    assert cfg.model.revision == got.commit and cfg.checkpoint.dir == str(tmp_path / "rel" / "ckpt")
    assert model_snapshot(hub_env, "org/tiny-math", cfg.model.revision) == got.path


def test_a_cached_split_without_the_fields_the_run_reads_is_refused(hub_env, monkeypatch):
    """The first record of the split's first cached file is read before submit, as of a local file."""
    from hpcrl.hub.check import check_inputs
    from tests.conftest import compose

    hub = standin({"org/gsm": data_repo()}, monkeypatch)
    try:
        fetch_split(hub_env, "hf:org/gsm:main", "train", "data.source", lambda _: None)
    finally:
        hub.__exit__()
    monkeypatch.setenv("HF_HOME", str(hub_env.parent))
    check_inputs(
        compose("data.source=hf:org/gsm:main", "data.prompt_field=question")
    )  # the tiny model: local
    with pytest.raises(
        ConfigError,
        match=r"^data\.source=hf:org/gsm:main: records have no field 'problem' \(set data\.prompt_field",
    ):
        check_inputs(compose("data.source=hf:org/gsm:main"))
