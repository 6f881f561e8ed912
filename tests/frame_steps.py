"""A job's step records as its store hands them to ``resihp follow``: from a trace frame."""

from __future__ import annotations

import pandas as pd


class FrameSteps:
    """The records of ``df`` (an ops trace), ``per_poll`` steps a poll, with the job's ``meta``."""

    meta_dict = None

    def __init__(self, df: pd.DataFrame, meta, per_poll: int = 10) -> None:
        self.df, self.meta, self.per_poll, self.at = df, meta, per_poll, 0

    def complete_steps(self) -> list[tuple[int, list[dict]]]:
        steps = sorted(self.df["step"].unique())[self.at : self.at + self.per_poll]
        self.at += self.per_poll
        return [(s, self.df[self.df["step"] == s].to_dict("records")) for s in steps]

    def finished(self) -> bool:
        return self.at >= self.df["step"].nunique()
