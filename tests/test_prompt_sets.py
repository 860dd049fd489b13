"""Held-out prompt sets by kind of task (``data/prompt_sets.py``): the rules that sort first turns, and the sets
read from ShareGPT past the training slices."""

from __future__ import annotations

import pytest

from fledge.core.errors import ConfigError
from fledge.data.prompt_sets import TASKS, TASKS_OFFSET, TRANSLATE, load_prompts, task_of


@pytest.mark.parametrize("turn, kind", [
    ("Écrivez-moi un poème sur la mer, s'il vous plaît, avec des rimes élégantes.", "translation"),
    ("请用三句话介绍一下长城的历史和它在今天的意义，并说明为什么每年有那么多人去参观它。", "translation"),
    # One accent is not another language, and chat takes turns without accents: neither.
    ("Write a poem for my fiancé about the sea and the stars at night, please.", None),
    ("Please summarize this article:\n\n" + "The committee met to discuss the budget. " * 30, "summarization"),
    ("Here is a report.\n\n" + "Revenue grew in every region last year. " * 45 + "\n\nWhich region grew most?",
     "passage_qa"),
    ("A train travels 120 km in 1.5 hours. How many km does it travel in 4 hours at that speed?", "math"),
    ("What are good ways to learn to play the guitar as an adult?", "chat"),
    ("ok", None),
    ("Tell me about this. " * 100, None),  # long, no question at its end, no summary asked
])
def test_first_turns_are_sorted_by_fixed_rules(turn, kind):
    found = task_of(turn)
    assert (found[0] if found else None) == kind
    if kind == "translation":
        assert found[1] == TRANSLATE + turn
    elif kind is not None:
        assert found[1] == turn


def test_task_sets_come_from_sharegpt_past_the_training_slices():
    math = load_prompts("tasks:math", max_prompts=4)
    assert len(math) == 4 and all(p["category"] == "math" for p in math)
    assert all(int(p["id"].split("-")[1]) >= TASKS_OFFSET for p in math)
    assert all(task_of(p["turns"][0])[0] == "math" for p in math)
    assert len({p["turns"][0] for p in math}) == 4
    assert load_prompts("tasks:math", max_prompts=2) == math[:2]  # the same prompts each time, in order
    translation = load_prompts("tasks:translation", max_prompts=16)
    assert len(translation) == 16 and all(p["turns"][0].startswith(TRANSLATE) for p in translation)
    with pytest.raises(ConfigError, match="no such kind"):
        load_prompts("tasks:poetry")
    assert set(TASKS) == {"translation", "summarization", "passage_qa", "math", "chat"}
