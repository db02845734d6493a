"""The shardlb HTTP client for game servers and tools: ``AsyncClient``, ``Client`` (blocking) and
``ScoreBuffer`` (many tasks' results in few requests). README.md, "For game developers", shows them."""

from shardlb.client.async_client import AsyncClient
from shardlb.client.backoff import Backoff
from shardlb.client.buffer import ScoreBuffer
from shardlb.client.errors import (
    ApiError,
    BoardClosed,
    BoardNotFound,
    BoardRebuilding,
    BoardResharding,
    ClientClosed,
    ClientError,
    Conflict,
    Forbidden,
    InvalidRequest,
    MalformedAnswer,
    NotFound,
    PlayerNotFound,
    RateLimited,
    TransportError,
    Unauthorized,
    Unavailable,
)
from shardlb.client.models import BoardInfo, Entry, MatchResult, Page, PlayerRank, ScoreOutcome
from shardlb.client.sync_client import BlockingScoreBuffer, Client

__all__ = [
    "ApiError",
    "AsyncClient",
    "Backoff",
    "BlockingScoreBuffer",
    "BoardClosed",
    "BoardInfo",
    "BoardNotFound",
    "BoardRebuilding",
    "BoardResharding",
    "Client",
    "ClientClosed",
    "ClientError",
    "Conflict",
    "Entry",
    "Forbidden",
    "InvalidRequest",
    "MalformedAnswer",
    "MatchResult",
    "NotFound",
    "Page",
    "PlayerNotFound",
    "PlayerRank",
    "RateLimited",
    "ScoreBuffer",
    "ScoreOutcome",
    "TransportError",
    "Unauthorized",
    "Unavailable",
]
