"""shardlb: one leaderboard spread over many Redis Cluster shards that reads like one sorted list."""

from shardlb.board import Board, Entry, PlayerEntry, Result, Score
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore

__all__ = [
    "Board",
    "BoardConfig",
    "BoardStore",
    "Entry",
    "PlayerEntry",
    "Result",
    "Score",
    "Scripts",
    "connect",
]
