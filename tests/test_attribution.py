"""``bench --attribution``: scoring against hand-computed values, and the real command path on the
tiny random model (its attention means nothing; the rows' shape and the resume do)."""

from __future__ import annotations

import json

import pytest

from cacheblend_bench import attribution as at


def _row(attention, holds, qid="q"):
    return {"model": "m", "qid": qid, "attention": attention, "supports_in_chunk": holds}


def test_rankings_and_scores_by_hand():
    row = _row([0.1, 0.2, 0.3, 0.4], [["A"], ["A", "B"], [], []])
    assert at.ranking(row, "attention", 2) == [3, 2]
    assert at.ranking(row, "retriever", 2) == [0, 1]
    assert at.ranking(row, "last", 2) == [3, 2]
    assert at.ranking(row, "attention_vs_position", 2, prior=[0.05, 0.1, 0.3, 0.8]) == [0, 1]  # 2.0, 2.0, 1.0, 0.5
    assert at.scores(row, "retriever", 2) == {"precision": 1.0, "recall": 1.0, "hit1": 1.0}
    assert at.scores(row, "attention", 2) == {"precision": 0.0, "recall": 0.0, "hit1": 0.0}
    assert at.scores(_row([0.5, 0.1, 0.4, 0.0], row["supports_in_chunk"]), "attention", 2) == {
        "precision": 0.5,
        "recall": 0.5,
        "hit1": 1.0,
    }
    assert at.scores(row, "random", 2) == {"precision": 0.5, "recall": 0.5, "hit1": 0.5}
    assert at.scores(_row([0.5, 0.5], [[], []]), "retriever", 1)["recall"] is None  # no evidence retrieved
    with pytest.raises(ValueError, match="unknown ranking 'best'"):
        at.ranking(row, "best", 2)
    with pytest.raises(ValueError, match="k=6 must be between 1 and top_k - 1"):
        at.AttributionConfig(k=6, top_k=6)


def test_summary_pairs_rankings_and_takes_the_position_prior_from_the_other_questions():
    rows = [
        _row([0.1, 0.2, 0.7], [["A"], [], []], "a"),
        _row([0.3, 0.1, 0.6], [[], ["A"], []], "b"),
        _row([0.2, 0.3, 0.5], [["A"], ["B"], []], "c"),
    ]
    prior = at.position_prior(rows)
    assert prior[0] == pytest.approx([0.25, 0.2, 0.55])
    s = at.summarize(rows, k=1)
    assert s["questions"] == 3 and s["share_by_place"] == pytest.approx([0.2, 0.2, 0.6])
    assert s["relevant_by_place"] == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert s["rankings"]["attention"]["precision"] == 0.0  # the last chunk every time
    assert s["rankings"]["retriever"]["precision"] == pytest.approx(2 / 3)
    c = s["comparisons"]["attention-retriever"]["precision"]
    assert (c["wins"], c["losses"], c["ties"]) == (0, 2, 1) and c["diff"] == pytest.approx(-2 / 3)
    table = at.markdown_table(s)
    assert "| attention vs retriever | -0.667 [" in table and "| mean attention share | 0.200 | 0.200 | 0.600 |" in table


def test_attribution_command_path_on_the_tiny_model(tmp_path):
    from cacheblend_bench import datasets as ds

    try:
        ds.hotpotqa_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    cfg = at.AttributionConfig(model="tiny", n=2, top_k=3, chunk_tokens=512, out_dir=str(tmp_path), progress=False)
    rows = at.run_attribution(cfg)
    assert len(rows) == 2
    for r in rows:
        assert len(r["attention"]) == len(r["supports_in_chunk"]) == 3 and sum(r["attention"]) == pytest.approx(1.0)
        assert (r["strategy"], r["recompute_ratio"]) == ("question", 0.15)
        assert r["supports"] == 2 and r["supports_found"] == 2  # both supporting paragraphs are in the documents
    lines = (tmp_path / at.ROWS).read_text().splitlines()
    assert [json.loads(line)["qid"] for line in lines] == [r["qid"] for r in rows]
    again = at.run_attribution(
        at.AttributionConfig(model="tiny", n=3, top_k=3, chunk_tokens=512, out_dir=str(tmp_path), progress=False)
    )
    assert len(again) == 3 and len((tmp_path / at.ROWS).read_text().splitlines()) == 3  # resumed: one new question
    assert at.table_from_file(tmp_path / at.ROWS, k=1).startswith("| chunks picked | precision@1 |")
