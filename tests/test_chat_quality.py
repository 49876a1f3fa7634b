"""benchmarks/chat_quality.py: its scoring functions against hand-computed cases, the question file,
and one run of the script on tiny random models whose result must agree with its own records."""

import json
import re

import pytest
from tests.helpers.factories import make_hf_model_dir

from benchmarks import chat_quality as cq


# ----------------------------------------------------------------------------- scoring


def test_answer_matching():
    assert cq.is_correct("The capital of France is Paris.", [r"\bparis\b"])
    assert cq.is_correct("PARIS", [r"\bparis\b"])  # case-insensitive
    assert not cq.is_correct("A Parisian cafe.", [r"\bparis\b"])
    assert cq.is_correct("It is twelve.", [r"\b12\b", r"\btwelve\b"])  # any pattern
    assert cq.is_correct("7 + 5 = 12", [r"\b12\b", r"\btwelve\b"])
    assert not cq.is_correct("The answer is 112.", [r"\b12\b", r"\btwelve\b"])
    assert not cq.is_correct("", [r"\b12\b"])


def test_four_gram_counts():
    assert cq.max_ngram_count([1, 2, 3]) == 0  # shorter than a 4-gram
    assert cq.max_ngram_count([1, 2, 3, 4]) == 1
    assert cq.max_ngram_count([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4]) == 3  # (1,2,3,4) at 0, 4, 8
    assert cq.max_ngram_count([5] * 6) == 3  # overlapping: (5,5,5,5) at 0, 1, 2
    assert cq.max_ngram_count([5] * 7) == 4  # over the limit: a loop
    assert cq.max_ngram_count([1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3, 4, 7, 1, 2, 3, 4]) == 4
    assert cq.max_ngram_count([1, 2, 1, 2, 1, 2], n=2) == 3


def test_ended_on_end_of_turn():
    assert cq.ended_on_eot([3, 9, 2], {2})
    assert cq.ended_on_eot([7, 1], {1, 2})
    assert not cq.ended_on_eot([2, 3], {2})  # EOS not last: cut at max tokens
    assert not cq.ended_on_eot([], {2})


def test_agreement_where_the_teacher_is_right():
    teacher = {"a": True, "b": True, "c": False, "d": True}
    assert cq.agreement({"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.5}, teacher) == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3
    assert cq.agreement({"a": 1.0, "b": 1.0, "c": 0.0, "d": 1.0}, teacher) == 1.0  # c does not count
    assert cq.agreement({"a": 1.0}, {"a": False}) is None


def test_summarize_by_hand():
    questions = [dict(id="a", loop_set=True), dict(id="b", loop_set=False), dict(id="c", loop_set=True)]
    rec = lambda q, ok, g, end: dict(id=q, correct=ok, max_4gram=g, ended=end, tokens=10)  # noqa: E731
    records = [rec("a", True, 2, True), rec("a", False, 5, False), rec("b", True, 9, False), rec("b", True, 1, True),
               rec("c", False, 4, False), rec("c", False, 3, True)]
    s = cq.summarize(records, questions, {"a": True, "b": False, "c": True})
    assert s["accuracy"] == pytest.approx(3 / 6)
    assert s["agreement"] == pytest.approx((0.5 + 0.0) / 2)  # a: 1 of 2 right, c: 0 of 2
    assert s["max_4gram"] == {"a": 5, "c": 4}  # b (count 9) is no loop prompt
    assert s["looping"] == 2 and s["loop_prompts"] == 2
    assert s["ended"] == pytest.approx(3 / 6)
    assert s["teacher_right"] == 2 and s["replies"] == 6 and s["tokens"] == 60
    assert cq.summarize(records, questions, None)["agreement"] is None


# ----------------------------------------------------------------------------- the question file


def test_question_file():
    rows = cq.load_questions()
    assert len(rows) >= 50
    assert len({r["id"] for r in rows}) == len(rows)
    assert {r["kind"] for r in rows} == {"fact", "instruction"}
    assert all(r["answers"] and r["question"].strip() for r in rows)
    for r in rows:
        for a in r["answers"]:
            re.compile(a, re.I)
    assert sum(bool(r.get("loop_set")) for r in rows) == cq.LOOP_PROMPTS


@pytest.mark.parametrize("question, right, wrong", [
    ("What is 7 plus 5?", "7 + 5 equals 12.", "The answer is 13."),
    ("Give one word that rhymes with cat.", "Hat.", "A word that rhymes with cat is dog."),
    ("List the three primary colours.", "Red, yellow and blue.", "Red and blue."),
    ("Count from one to five.", "1, 2, 3, 4, 5", "One, two, three."),
    ("What is the chemical symbol for gold?", "Its symbol is Au.", "It is Ag."),
])
def test_patterns_accept_and_reject(question, right, wrong):
    patterns = next(r["answers"] for r in cq.load_questions() if r["question"] == question)
    assert cq.is_correct(right, patterns)
    assert not cq.is_correct(wrong, patterns)


def test_bad_question_files_are_refused(tmp_path):
    row = dict(id="x", kind="fact", question="Q?", answers=["a"])
    cases = [[row, row], [dict(row, answers=["("])], [dict(row, answers=[])], [dict(row, kind="other")]]
    for rows in cases:
        path = tmp_path / "q.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
        with pytest.raises((ValueError, re.error)):
            cq.load_questions(path)


# ----------------------------------------------------------------------------- end to end


def test_script_on_tiny_models(tmp_path):
    model = make_hf_model_dir(tmp_path / "model", seed=1)
    teacher = make_hf_model_dir(tmp_path / "teacher", seed=2)
    rows = [dict(id=f"q{i}", kind="fact" if i % 2 else "instruction", question=f"Tell me about item {i}.",
                 answers=["zzzqqq"] if i % 3 == 0 else ["."], loop_set=i < 3) for i in range(5)]
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "results"
    argv = ["--model", str(model), "--teacher", str(teacher), "--questions", str(qfile), "--max-tokens", "12",
            "--sweep", "--samples", "2", "--results", str(out), "--label", "test"]
    assert cq.main(argv) == 0
    (path,) = out.glob("*.json")
    assert path.name == "chat-quality-model-test.json"
    d = json.loads(path.read_text())
    assert d["n_questions"] == 5 and d["kinds"] == {"instruction": 3, "fact": 2}
    assert d["teacher"]["setting"] == "greedy" and len(d["teacher"]["records"]) == 5
    assert len(d["runs"]) == 9  # 3 greedy (penalty 1.0, 1.1, 1.2) + 2 temperatures x top-p 0.9 x 3 penalties
    teacher_right = {r["id"]: r["correct"] for r in d["teacher"]["records"]}
    for r in d["teacher"]["records"]:
        # "." matches any non-empty reply, "zzzqqq" none a random model writes in 12 tokens
        assert r["correct"] == (r["reply"] != "" and r["id"] not in ("q0", "q3"))
    for run in d["runs"]:
        recs, s = run["records"], run["summary"]
        greedy = run["sampling"]["temp"] == 0
        assert len(recs) == s["replies"] == 5 * (1 if greedy else 2)
        assert [r["sample"] for r in recs if r["id"] == "q1"] == ([0] if greedy else [0, 1])
        assert s["accuracy"] == pytest.approx(sum(r["correct"] for r in recs) / len(recs))
        assert s["ended"] == pytest.approx(sum(r["ended"] for r in recs) / len(recs))
        assert s["tokens"] == sum(r["tokens"] for r in recs)
        assert all(1 <= r["tokens"] <= 12 and (r["ended"] or r["tokens"] == 12) for r in recs)
        assert s["max_4gram"] == {q: max(r["max_4gram"] for r in recs if r["id"] == q) for q in ("q0", "q1", "q2")}
        assert s["looping"] == sum(v > 3 for v in s["max_4gram"].values())
        right = [q for q, ok in teacher_right.items() if ok]
        if right:
            score = lambda q: sum(r["correct"] for r in recs if r["id"] == q) / sum(r["id"] == q for r in recs)  # noqa: E731
            assert s["agreement"] == pytest.approx(sum(score(q) for q in right) / len(right))
    clean = [i for i, run in enumerate(d["runs"]) if run["summary"]["looping"] == 0]
    if clean:
        assert d["best"] in clean
        agree = lambda i: d["runs"][i]["summary"]["agreement"] or 0.0  # noqa: E731
        assert agree(d["best"]) == max(agree(i) for i in clean)
    else:
        assert d["best"] is None
    # reply s of question i is sampled with seed --seed (0) + 1000 s + i
    sampled = [run for run in d["runs"] if run["sampling"]["temp"] > 0]
    assert all(r["seed"] == 1000 * r["sample"] + int(r["id"][1:]) for run in sampled for r in run["records"])
