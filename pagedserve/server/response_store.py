"""The Responses API's store (`store: true`, `previous_response_id`, GET / DELETE
/v1/responses/{id}): an embedded SQLite database, so a conversation continues across a
server restart.

Bounded by age and size: on every write, responses older than `max_age_s` are deleted,
and while the database holds more than `max_bytes` the oldest tenth goes (then the file
is vacuumed). Each row keeps the response object and the conversation that led to it
(chat messages, the response's own output included), which is what a continuation needs.
Calls are short and synchronous; the server runs them off the event loop.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time

SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, created_at REAL NOT NULL, response TEXT NOT NULL, conversation TEXT NOT NULL)"""


class ResponseStore:
    def __init__(self, path: str, max_bytes: int = 256 << 20, max_age_s: float = 30 * 86400) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self.max_bytes, self.max_age_s = path, max_bytes, max_age_s
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(SCHEMA)
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (response["id"], time.time(), json.dumps(response), json.dumps(conversation)),
            )
            self._bound()

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        """(response, conversation), or None if unknown, deleted or expired."""
        with self._lock:
            row = self._db.execute(
                "SELECT response, conversation FROM responses WHERE id = ? AND created_at >= ?",
                (response_id, time.time() - self.max_age_s),
            ).fetchone()
        return (json.loads(row[0]), json.loads(row[1])) if row else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def _bound(self) -> None:
        self._db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))
        while self._size() > self.max_bytes:
            n = self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
            if n == 0:
                break
            self._db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at LIMIT ?)",
                (max(1, n // 10),),
            )
            self._db.execute("VACUUM")

    def _size(self) -> int:
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * self._db.execute("PRAGMA page_size").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
