"""Data loading: local JSONL/Parquet with the field mappings of the common math datasets."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl.data.loader import PromptStream, load_examples
from hpcrl.data.synthetic import synthetic_split
from hpcrl.errors import ConfigError
from tests.conftest import compose


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))


def test_openmathinstruct2_jsonl(tmp_path):
    f = tmp_path / "omi2.jsonl"
    write_jsonl(
        f,
        [
            {"problem": f"What is {i}+1?", "expected_answer": str(i + 1), "generated_solution": "..."}
            for i in range(40)
        ],
    )
    cfg = compose("data=openmathinstruct2", f"data.source={f}", "data.val_fraction=0.1").data
    train, val = load_examples(cfg, seed=0)
    assert len(train) == 36 and len(val) == 4
    assert "Please reason step by step" in train[0].prompt
    assert {e.answer for e in train + val} == {str(i + 1) for i in range(40)}


def test_dapo_math_17k_parquet_chat_prompt_and_nested_answer(tmp_path):
    f = tmp_path / "dapo.parquet"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Compute {i}*2."}],
            "reward_model": {"ground_truth": str(2 * i)},
        }
        for i in range(10)
    ]
    pq.write_table(pa.Table.from_pylist(rows), f)
    v = tmp_path / "math500.jsonl"
    write_jsonl(v, [{"problem": "1+1", "answer": "2"}])
    cfg = compose("data=dapo_math_17k", f"data.source={f}", f"data.val_source={v}").data
    train, val = load_examples(cfg, seed=0)
    assert train[3].answer == "6" and "Compute 3*2." in train[3].prompt and "Answer:" in train[3].prompt
    assert len(val) == 1


def test_missing_field_names_the_key(tmp_path):
    f = tmp_path / "x.jsonl"
    write_jsonl(f, [{"question": "q", "answer": "1"}])
    with pytest.raises(ConfigError, match="no field 'problem'"):
        compose("data=math500", f"data.source={f}")  # checked before anything is submitted
    cfg = compose("data=math500", f"data.source={f}", "data.check_source=false").data
    with pytest.raises(ConfigError, match="no field 'problem'"):
        load_examples(cfg, seed=0)  # and by the job, for a file only the compute nodes see


def test_synthetic_validation_is_held_out():
    train, val = synthetic_split(2000, 128, seed=0)
    assert not {p.prompt for p in train} & {p.prompt for p in val}
    assert all(str(eval(p.prompt[:-1])) == p.answer for p in train[:50])


def test_prompt_stream_resumes_at_the_same_position():
    examples, _ = load_examples(compose("data=synthetic_math").data, seed=0)
    a = PromptStream(examples, seed=3)
    a.take(5000)  # crosses an epoch boundary
    b = PromptStream(examples, seed=3)
    b.restore(a.state())
    assert a.take(10) == b.take(10)
