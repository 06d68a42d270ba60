"""The prompts the tests share, one copy each.

``PROMPTS``: short ones across the families the product is benchmarked on (chat, code,
summary). ``LONG_PROMPTS``: prose, a code edit, a summary, an explanation; two of them run to
a 256-token limit, so drafts get both accepted and rejected. ``TURNS``: one multi-turn
conversation. ``RAW_PROMPTS``: plain text (no chat template) where a broken verifier shows.
"""

from __future__ import annotations

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Summarize in one sentence: The cat sat on the mat all day, watching birds outside.",
    "List three colors of the rainbow.",
    "Explain what a hash table is.",
]

LONG_PROMPTS = [
    "Write a long, detailed story about a robot who learns to cook. Use many paragraphs.",
    "Rewrite this Python code with snake_case names and return the whole code:\n\n"
    "def computeTotal(itemList, taxRate):\n    runningSum = 0\n    for singleItem in itemList:\n"
    "        runningSum += singleItem.unitPrice * singleItem.itemCount\n"
    "    return runningSum * (1 + taxRate)\n",
    "Summarize in detail: The city council met on Tuesday to discuss the new public transport "
    "plan. It proposes three bus lines, a bike-sharing program and longer opening hours for the "
    "central station. Members disagreed about the cost; a business association supported it.",
    "Explain in detail how a hash table works, with examples, collisions, resizing and complexity.",
]

TURNS = ["Name a fruit and describe it.", "Now list three more, each with a recipe.", "Thanks!"]

# Positions where a wrong residual step shows: the N-gram drafter proposes " apples", which
# the target gives p = 0.49 at T = 0.8 (a broken verifier: 0.74); the weak draft model puts
# q = 0.99 on " and", which the target gives p = 0.22 (broken: 0.39).
RAW_PROMPTS = {
    "anpd": "My favourite fruits: apples, pears, plums. Her favourite fruits:",
    "sd": "Colors: red, green,",
}
