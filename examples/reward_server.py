"""A remote reward scorer for the default task (copy_digits), as a small FastAPI app.

Run it, then point a training run at it:

    python examples/reward_server.py --port 8123            # or: uv run examples/reward_server.py
    uv run grail-train 'data.rewards=[{fn: "http://127.0.0.1:8123/score", name: remote_exact}]'

Each batch arrives as one POST /score with per-sample lists (docs/rewards.md):

    {"prompts": ["Repeat: 7", ...], "completions": ["7", ...], "answers": ["7", ...],
     "num_digits": [1, ...]}

and the answer is one number per completion, `{"rewards": [1.0, ...]}` (a bare JSON list works
too). The score mirrors copy_digits' own `correct` component: 1.0 when the completion, cut at
the first end-of-turn marker and stripped of whitespace, equals the answer, else 0.0. A real
scorer would do something the harness cannot (a model judge, a sandbox running code, ...); this
one shows the protocol, including a 422 with a `detail` message for a malformed batch, which
the harness quotes in its error.

It only needs fastapi and uvicorn (dependencies of grail); `create_app()` builds the app without
serving it, for tests and for mounting into another app.
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict

# What a generator may leave in the text when it keeps special tokens: the turn ends there.
END_OF_TURN = ("<|im_end|>", "<|endoftext|>")


class ScoreRequest(BaseModel):
    # Every problem meta key also arrives as a list (copy_digits sends `num_digits`); accepted
    # and ignored here, so a new key never breaks the scorer.
    model_config = ConfigDict(extra="allow")

    prompts: list[str]
    completions: list[str]
    answers: list[Any]


class ScoreResponse(BaseModel):
    rewards: list[float]


def exact_match(completion: str, answer: object) -> float:
    """1.0 iff the completion up to the end of its turn, stripped, is the answer (as text)."""
    text = completion
    for marker in END_OF_TURN:
        text = text.split(marker, 1)[0]
    return 1.0 if text.strip() == str(answer).strip() else 0.0


def create_app() -> FastAPI:
    app = FastAPI(title="copy_digits exact-match scorer")

    @app.post("/score")
    def score(request: ScoreRequest) -> ScoreResponse:
        n = len(request.completions)
        if len(request.prompts) != n or len(request.answers) != n:
            raise HTTPException(
                status_code=422,
                detail=f"{len(request.prompts)} prompts, {n} completions and "
                f"{len(request.answers)} answers: the lists must have one entry per sample",
            )
        return ScoreResponse(
            rewards=[
                exact_match(c, a) for c, a in zip(request.completions, request.answers, strict=True)
            ]
        )

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8123, help="port to listen on (0: any free)")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
