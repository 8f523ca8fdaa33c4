"""DAPO's answer-line reward, ported from verl `verl/utils/reward_score/math_dapo.py` (the reward of DAPO-Math-17k,
`data_source: math_dapo`): the last `Answer:` line in the last 300 characters of a response, normalized as
Minerva's `normalize_final_answer`, compared as a string with the normalized gold. Model text is only matched by
regular expressions and string replacements, never evaluated. Also DAPO's prompt template, and the check of
whether a prompt asks for such an answer line.
"""
import re

# DAPO-Math-17k's prompt: each problem wrapped in this instruction (the dataset's `prompt[0].content`).
ANSWER_LINE_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
                      "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
ANSWER_LINE_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
# A prompt that asks for the answer on an `Answer:` line: DAPO's "of the form Answer: $Answer" / 'after "Answer:"'.
ASKS_FOR_ANSWER_LINE = re.compile(r'(?i)\bAnswer:\s*\$?answer\b|after\s+"Answer:"')

# verl math_dapo.py (adapted there from lm-evaluation-harness hendrycks_math), in its order.
SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
REMOVED_EXPRESSIONS = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
                       "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
                       "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
                       "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
                       r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots"]
ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"  # verl's is_correct_minerva default
RESPONSE_TAIL_CHARS = 300  # verl's compute_score keeps the last 300 characters ("the longest MATH-500 answer: 159")


def normalize_final_answer(final_answer):
    """verl math_dapo.normalize_final_answer: the text after the last `=`, units and \\text{} dropped, $...$ and
    \\text{}, \\textbf{}, \\overline{}, \\boxed{} unwrapped, \\fracab -> \\frac{a}{b}, \\sqrta -> \\sqrt{a}, `$`
    removed, thousands commas dropped from a plain number, stripped."""
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expression in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expression, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def answer_line_correct(response, gold):
    """verl math_dapo.compute_score (strict_box_verify off): True if the last `Answer:` line of the response's last
    300 characters, normalized, equals the normalized gold (no `Answer:` line: the prediction is `[INVALID]`)."""
    matches = re.findall(ANSWER_PATTERN, response[-RESPONSE_TAIL_CHARS:])
    return normalize_final_answer(matches[-1] if matches else "[INVALID]") == normalize_final_answer(gold)
