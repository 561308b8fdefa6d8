"""Predicted outputs on the real model: the same chat requests with and without a `prediction`,
through a running coordinator's OpenAI-compatible API, interleaved.

    .venv/bin/specdec up &     # the default stack: n-gram drafting, the target drafting by lookup
    .venv/bin/python benchmarks/prediction.py [--base http://127.0.0.1:8000] [--repeats 3] [--max-tokens 128]

For each question it first asks without a prediction (the answer A), then, interleaved over
--repeats: without a prediction, with A as the prediction (a request asked again, or regenerated
after a small edit elsewhere), and with A edited (every 8th word replaced). Prints tokens per
second (client wall), target steps per token (from the response's `speculation`), and whether the
content equals A (greedy: it must, whatever the prediction).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

QUESTIONS = [
    "Explain in a short paragraph how a bicycle's gears make pedalling easier uphill.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "List five tips for writing clear technical documentation, one sentence each.",
    "Describe the water cycle for a ten-year-old in a few sentences.",
]


def chat(base: str, question: str, max_tokens: int, prediction: str | None) -> tuple[str, float, dict]:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    return answer["choices"][0]["message"]["content"], time.perf_counter() - start, answer


def edited(text: str) -> str:
    """Every 8th word replaced: a prediction that is mostly, not wholly, right."""
    return " ".join("indeed" if i % 8 == 7 else w for i, w in enumerate(text.split(" ")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    rows = {"no prediction": [0.0, 0, 0, 0], "the answer itself": [0.0, 0, 0, 0], "the answer, every 8th word changed": [0.0, 0, 0, 0]}
    for question in QUESTIONS:
        answer, _, _ = chat(args.base, question, args.max_tokens, None)
        predictions = {"no prediction": None, "the answer itself": answer, "the answer, every 8th word changed": edited(answer)}
        for _ in range(args.repeats):
            for row, prediction in predictions.items():
                text, wall, response = chat(args.base, question, args.max_tokens, prediction)
                r = rows[row]
                r[0] += wall
                r[1] += response["usage"]["completion_tokens"]
                r[2] += response["speculation"]["steps"]
                r[3] += text == answer
    base = rows["no prediction"][1] / rows["no prediction"][0]
    for row, (wall, tokens, steps, same) in rows.items():
        print(f"{row:36s} {tokens / wall:7.1f} tok/s  {tokens / wall / base:4.2f}x  {steps / tokens:.2f} steps/token  "
              f"same as without: {same}/{len(QUESTIONS) * args.repeats}")


if __name__ == "__main__":
    main()
