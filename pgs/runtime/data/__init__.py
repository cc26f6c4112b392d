"""Training data: reading, chat masks, packing, mixing, resume (see docs/data.md)."""

from pgs.runtime.data.chat import assistant_spans, encode_chat
from pgs.runtime.data.config import DataConfig, DataSource
from pgs.runtime.data.isolation import IsolationVerdict, packing_isolation, require_packing_isolation
from pgs.runtime.data.packing import IGNORE_INDEX, Document, PackedBatch, best_fit_decreasing, collate
from pgs.runtime.data.readers import read_conversations
from pgs.runtime.data.records import Conversation, parse_line
from pgs.runtime.data.stats import DataStats
from pgs.runtime.data.stream import EvalStream, TrainStream, encode_document

__all__ = [
    "IGNORE_INDEX",
    "Conversation",
    "DataConfig",
    "DataSource",
    "DataStats",
    "Document",
    "EvalStream",
    "IsolationVerdict",
    "PackedBatch",
    "TrainStream",
    "assistant_spans",
    "best_fit_decreasing",
    "collate",
    "encode_chat",
    "encode_document",
    "packing_isolation",
    "parse_line",
    "read_conversations",
    "require_packing_isolation",
]
