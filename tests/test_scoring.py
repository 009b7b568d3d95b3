"""Every scorer's pass, fail and invalid cases; suites rejected with the path of the bad field."""

import pytest

from kiln.native.scoring import SuiteError, load_suite, score

EX = {"target": "42", "aliases": ["forty-two"]}


@pytest.mark.parametrize("answer,spec,example,want", [
    (" 42 ", {"type": "exact_match"}, EX, "pass"),
    ("Forty-Two", {"type": "exact_match"}, EX, "pass"),
    ("Forty-Two", {"type": "exact_match", "case_sensitive": True}, EX, "fail"),
    ("41", {"type": "exact_match"}, EX, "fail"),
    ("  \n", {"type": "exact_match"}, EX, "invalid"),
    ("The answer is 42.", {"type": "contains"}, EX, "pass"),
    ("red and blue", {"type": "contains", "phrases": ["red", "green"], "mode": "all"}, EX, "fail"),
    ("red and green", {"type": "contains", "phrases": ["red", "green"], "mode": "all"}, EX, "pass"),
    ("nothing", {"type": "contains"}, EX, "fail"),
    ("", {"type": "contains"}, EX, "invalid"),
    ("Answer: 42", {"type": "regex", "pattern": r"Answer:\s*(\d+)", "capture_group": 1}, EX, "pass"),
    ("Answer: 41", {"type": "regex", "pattern": r"Answer:\s*(\d+)", "capture_group": 1}, EX, "fail"),
    ("no answer here", {"type": "regex", "pattern": r"Answer:\s*(\d+)", "capture_group": 1}, EX, "invalid"),
    ("It costs $1,234.50 in total", {"type": "numeric_tolerance", "atol": 0.01}, {"target": 1234.5}, "pass"),
    ("about 99%", {"type": "numeric_tolerance", "rtol": 0.05}, {"target": 100}, "pass"),
    ("first 3 then 7", {"type": "numeric_tolerance"}, {"target": 3}, "fail"),
    ("I don't know", {"type": "numeric_tolerance"}, {"target": 3}, "invalid"),
    ("The answer is (B).", {"type": "multiple_choice", "choices": ["A", "B", "C"]}, {"target": "B"}, "pass"),
    ("C is right", {"type": "multiple_choice", "choices": ["A", "B", "C"]}, {"target": "B"}, "fail"),
    ("none of them", {"type": "multiple_choice", "choices": ["A", "B", "C"]}, {"target": "B"}, "invalid"),
    ('{"a": {"b": [1, 2]}}', {"type": "json_validity", "required_paths": ["a.b.1"]}, EX, "pass"),
    ('```json\n{"a": 1}\n```', {"type": "json_validity", "required_paths": ["a.b"]}, EX, "fail"),
    ("{not json", {"type": "json_validity"}, EX, "invalid"),
    ("42 apples", {"type": "all", "scorers": [{"type": "contains"}, {"type": "numeric_tolerance"}]}, EX, "pass"),
    ("43 apples", {"type": "all", "scorers": [{"type": "contains", "phrases": ["apples"]}, {"type": "numeric_tolerance"}]}, EX, "fail"),
    ("43 apples", {"type": "any", "scorers": [{"type": "contains", "phrases": ["apples"]}, {"type": "numeric_tolerance"}]}, EX, "pass"),
    ("words", {"type": "all", "scorers": [{"type": "numeric_tolerance"}, {"type": "json_validity"}]}, EX, "invalid"),
    ("words", {"type": "any", "scorers": [{"type": "numeric_tolerance"}, {"type": "json_validity"}]}, EX, "invalid"),
    ("x", {"type": "regex", "pattern": "("}, EX, "error"),
])
def test_scorers(answer, spec, example, want):
    assert score(answer, example, spec).outcome == want


def _suite(**over):
    base = {"name": "s", "examples": [{"messages": [{"role": "user", "content": "1+1?"}], "target": "2"}]}
    base.update(over)
    return base


def test_a_valid_suite_gets_ids_defaults_and_a_stable_hash():
    s = load_suite(_suite(default_scorer="numeric_tolerance"))
    assert s.examples[0]["id"] and s.examples[0]["scorer"] == {"type": "numeric_tolerance"}
    assert s.generation["temperature"] == 0.0 and s.hash == load_suite(_suite(default_scorer="numeric_tolerance")).hash


@pytest.mark.parametrize("suite,path", [
    (_suite(name=""), "name"),
    (_suite(examples=[]), "examples"),
    (_suite(examples=[{"messages": [{"role": "user", "content": "x"}], "target": 1},
                      {"messages": [{"role": "bot", "content": "x"}], "target": 1}]), "examples[1].messages"),
    (_suite(examples=[{"messages": [{"role": "user", "content": "x"}]}]), "examples[0].target"),
    (_suite(examples=[{"messages": [{"role": "user", "content": "x"}], "target": 1,
                       "scorer": {"type": "numeric_tolerance", "atol": -1}}]), "examples[0].scorer.atol"),
    (_suite(examples=[{"messages": [{"role": "user", "content": "x"}], "target": 1,
                       "scorer": {"type": "regex", "pattern": "(("}}]), "examples[0].scorer.pattern"),
    (_suite(generation={"temprature": 0}), "generation.temprature"),
    (_suite(default_scorer={"type": "all", "scorers": []}), "default_scorer.scorers"),
])
def test_a_malformed_suite_is_rejected_with_the_path_of_the_bad_field(suite, path):
    with pytest.raises(SuiteError) as e:
        load_suite(suite)
    assert e.value.path == path
