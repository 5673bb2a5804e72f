"""The trajectory log: ordered, persisted operations per sandbox (and LLM calls per episode),
fast-forward on replay, provenance queries and deterministic replay (docs/trajlog.md)."""
from .log import Outcome, Stream, TrajectoryLog, request_hash
from .sandbox import LoggedSandbox, ReplayReport, fast_forward, replay, restore
from .store import DONE, PENDING, UNKNOWN, Entry, JournaledLogStore, LogStore, SQLiteLogStore, StreamInfo

__all__ = ["DONE", "PENDING", "UNKNOWN", "Entry", "JournaledLogStore", "LogStore", "LoggedSandbox", "Outcome",
           "ReplayReport", "SQLiteLogStore", "Stream", "StreamInfo", "TrajectoryLog", "fast_forward", "replay",
           "request_hash", "restore"]
