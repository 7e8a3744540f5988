"""The seeds' data sets by name (``data=<name>``): records shaped like each real data set, written here
as a small local file with the real field names, become the right prompt and reference answer, and the
data set's verifier scores a right and a wrong completion. (The hub files themselves: tests/test_hub*.)"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl.data.loader import load_examples
from hpcrl.data.templates import TEMPLATES, render_prompt
from hpcrl.errors import ConfigError
from hpcrl.rewards.verifiers import REGISTRY, Outcome
from tests.conftest import compose

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_REMINDER = '\n\nRemember to put your answer on its own line after "Answer:".'


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def scores(cfg, example, right: str, wrong: str) -> tuple[Outcome, Outcome]:
    verify = REGISTRY[cfg.verifier]
    return (
        verify(right, example.answer, example.prompt).outcome,
        verify(wrong, example.answer, example.prompt).outcome,
    )


def test_dapo_math_17k_carries_the_instruction_once_and_its_repeats_are_one_example(tmp_path):
    """DAPO-Math-17k's prompt is DAPO's instruction around the problem (the dapo template word for word):
    not wrapped twice. The hub file repeats each prompt ~100 times: one example each. MATH-500 (its
    validation set) gets the instruction from the template."""
    problems = ["In triangle $ABC$, $AB = 5$. Find $BC^2$.", "How many primes are below $20$?"]
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_INSTRUCTION + p + DAPO_REMINDER, "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{i}"},
        }
        for i, (p, a) in enumerate(zip(problems, ["34", "8"], strict=True))
    ]
    train_file = write_parquet(tmp_path / "dapo-math-17k.parquet", rows * 3)
    val_file = write_jsonl(
        tmp_path / "test.jsonl",
        [{"problem": "What is $1+1$?", "solution": "...", "answer": "2", "subject": "Algebra", "level": 1}],
    )
    cfg = compose("data=dapo_math_17k", f"data.source={train_file}", f"data.val_source={val_file}").data
    train, val = load_examples(cfg, seed=0)
    assert [e.prompt for e in train] == [r["prompt"][0]["content"] for r in rows]  # as is, deduplicated
    assert all(e.prompt.count("Solve the following math problem") == 1 for e in train + val)
    assert all(e.prompt.count('after "Answer:"') == 1 for e in train + val)
    assert val[0].prompt == render_prompt("dapo", "What is $1+1$?") and val[0].answer == "2"
    assert scores(cfg, train[0], "so $BC^2 = 34$.\nAnswer: 34", "Answer: 35") == (
        Outcome.correct,
        Outcome.wrong,
    )


def test_a_template_is_added_to_a_bare_problem_once():
    for name in ("dapo", "cot", "answer_tags"):
        once = render_prompt(name, "What is 2+3?")
        assert once != "What is 2+3?" and render_prompt(name, once) == once, name
    assert TEMPLATES["plain"] == "{problem}" and render_prompt("plain", "x") == "x"


def test_math500(tmp_path):
    f = write_jsonl(
        tmp_path / "test.jsonl",
        [
            {
                "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
                "solution": "... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
                "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                "subject": "Precalculus",
                "level": 2,
                "unique_id": f"test/precalculus/{i}.json",
            }
            for i in range(20)
        ],
    )
    cfg = compose("data=math500", f"data.source={f}").data
    train, val = load_examples(cfg, seed=0)
    assert len(train) + len(val) == 1  # twenty copies of one problem
    (example,) = train + val
    assert example.prompt.startswith("Convert the point") and "\\boxed{}" in example.prompt
    right = "The polar coordinates are $\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}$."
    assert scores(cfg, example, right, "$\\boxed{(3, \\pi)}$") == (Outcome.correct, Outcome.wrong)


@pytest.mark.parametrize(
    ("option", "filename", "row"),
    [
        (
            "aime2024",
            "train-00000-of-00001.parquet",
            {
                "id": 60,
                "problem": "Find the number of rectangles inside a fixed regular dodecagon.",
                "solution": "...",
                "answer": "315",
                "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_II_Problems/Problem_15",
                "year": "2024",
            },
        ),
        (
            "aime2025",
            "test.jsonl",
            {
                "problem": "Find the sum of all integer bases $b>9$ for which $17_b$ divides $97_b$.",
                "answer": "70",
                "id": "0",
            },
        ),
    ],
)
def test_aime(tmp_path, option, filename, row):
    path = tmp_path / filename
    (write_parquet if filename.endswith(".parquet") else write_jsonl)(path, [row])
    cfg = compose(f"data={option}", f"data.source={path}").data
    train, val = load_examples(cfg, seed=0)
    (example,) = train + val
    assert example.prompt == render_prompt("cot", row["problem"]) and example.answer == row["answer"]
    right, wrong = f"... so the answer is $\\boxed{{{row['answer']}}}$.", "$\\boxed{1}$"
    assert scores(cfg, example, right, wrong) == (Outcome.correct, Outcome.wrong)


def test_openmathinstruct2_keeps_one_example_per_problem(tmp_path):
    rows = [
        {
            "problem": f"A bookshelf has {i} shelves with 8 books each. How many books?",
            "generated_solution": f"Solution {k}: ... \\boxed{{{8 * i}}}",
            "expected_answer": str(8 * i),
            "problem_source": "augmented_gsm8k",
        }
        for i in range(1, 41)
        for k in range(2)  # two generated solutions per problem, as in the data set
    ]
    f = write_parquet(tmp_path / "train_1M-00000-of-00001.parquet", rows)
    cfg = compose("data=openmathinstruct2", f"data.source={f}").data
    train, val = load_examples(cfg, seed=0)
    assert len(train) + len(val) == 40 and len(val) == 2  # 5% held out
    example = next(e for e in train + val if e.prompt.startswith("A bookshelf has 5 shelves"))
    assert example.answer == "40"
    assert scores(cfg, example, "5 * 8 = 40, so $\\boxed{40}$", "$\\boxed{13}$") == (
        Outcome.correct,
        Outcome.wrong,
    )


def test_gsm8k_reference_is_the_number_after_the_four_hashes(tmp_path):
    solution = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
    )
    question = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?"
    )
    train_file = write_parquet(
        tmp_path / "train-00000-of-00001.parquet", [{"question": question, "answer": solution}]
    )
    test_file = write_parquet(
        tmp_path / "test-00000-of-00001.parquet",
        [
            {
                "question": "Janet has 3 apples and buys 1,200 more. How many?",
                "answer": "3+1200=1203\n#### 1,203",
            }
        ],
    )
    cfg = compose("data=gsm8k", f"data.source={train_file}", f"data.val_source={test_file}").data
    (train,), (val,) = load_examples(cfg, seed=0)
    assert train.prompt == render_prompt("cot", question) and train.answer == "72"
    assert val.answer == "1,203"
    assert scores(cfg, train, "24 + 48 = 72. \\boxed{72}", "\\boxed{24}") == (Outcome.correct, Outcome.wrong)
    assert scores(cfg, val, "\\boxed{1203}", "\\boxed{1200}") == (Outcome.correct, Outcome.wrong)


def test_a_parquet_file_is_read_for_the_fields_the_run_uses_only(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hpcrl.data.loader import read_file

    path = tmp_path / "dapo.parquet"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"p{i}"}],
            "reward_model": {"ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    read = read_file(path, ("prompt", "reward_model.ground_truth"))
    assert [sorted(r) for r in read] == 3 * [["prompt", "reward_model"]]
    assert read[2]["reward_model"]["ground_truth"] == "2" and "extra_info" in read_file(path)[0]


def test_geo3k_rows_carry_their_images(tmp_path):
    """Geometry3K as the hub's Parquet holds it: an ``images`` column of {bytes, path} cells and a
    problem that says ``<image>`` where its figure goes. Each example carries its image's file bytes,
    the marker leaves the text (the processor's chat template places images); a path-only cell is read
    from its file; a column of something else is refused naming the key."""
    from tests.tiny_vlm import png

    on_disk = tmp_path / "figure.png"
    on_disk.write_bytes(png(2))
    rows = [
        {"images": [{"bytes": png(0), "path": None}], "problem": "<image>Find x.", "answer": "3"},
        {"images": [{"bytes": None, "path": str(on_disk)}], "problem": "<image>Find y.", "answer": "4"},
    ]
    train = write_parquet(tmp_path / "train.parquet", rows)
    val = write_parquet(tmp_path / "validation.parquet", rows[:1])
    cfg = compose("data=geo3k", f"data.source={train}", f"data.val_source={val}").data
    assert cfg.image_field == "images"
    examples, held_out = load_examples(cfg, seed=0)
    by_answer = {e.answer: e for e in examples}
    assert by_answer["3"].images == (png(0),) and by_answer["4"].images == (png(2),)
    assert by_answer["3"].prompt == render_prompt(cfg.template, "Find x.")
    assert [e.images for e in held_out] == [(png(0),)]
    # a record without an image would make a text row in an image batch: left out, with one warning
    mixed = write_parquet(tmp_path / "mixed.parquet", [*rows, {"images": [], "problem": "p", "answer": "9"}])
    with pytest.warns(UserWarning, match=r"1 records have no image in data\.image_field=images; left out"):
        examples, _ = load_examples(
            compose("data=geo3k", f"data.source={mixed}", f"data.val_source={val}").data, seed=0
        )
    assert sorted(e.answer for e in examples) == ["3", "4"]
    bad = write_parquet(tmp_path / "bad.parquet", [{"images": [3], "problem": "p", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"data\.image_field=images holds int"):
        load_examples(compose("data=geo3k", f"data.source={bad}", f"data.val_source={val}").data, seed=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data=geo3k", "rollout=hf"], r"rollout=hf generates from text only; use rollout=vllm"),
        (["data=geo3k", "rollout.language_model_only=true"], r"set rollout\.language_model_only=false"),
        (["data.image_field=images"], r"data\.source=synthetic has no images"),
    ],
)
def test_an_image_set_refuses_what_cannot_take_images(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(*overrides, "data.check_source=false")
