"""The durable trajectory store: episodes in SQLite (WAL), appended atomically.

``append`` returns only after the transaction has committed with ``synchronous=FULL``, so an
episode that was acknowledged survives a SIGKILL of the writer or a power cut. Readers see
either the whole episode or none of it.

>>> store = TrajectoryStore(":memory:")
>>> store.append(Episode(task_id="t0", reward=1.0))
>>> store.count()
1
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from areal_sdk.trajectory import Episode, EpisodeStatus

STORE_FILENAME = "trajectories.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    id            TEXT NOT NULL UNIQUE,
    run_id        TEXT NOT NULL,
    task_id       TEXT NOT NULL,
    group_id      TEXT,
    status        TEXT NOT NULL,
    reward        REAL,
    min_version   INTEGER,
    max_version   INTEGER,
    num_tokens    INTEGER NOT NULL,
    started       REAL NOT NULL,
    ended         REAL,
    stored        REAL NOT NULL,
    consumed_step INTEGER,
    body          TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS episodes_run ON episodes(run_id, status);
CREATE INDEX IF NOT EXISTS episodes_group ON episodes(group_id);
CREATE INDEX IF NOT EXISTS episodes_version ON episodes(min_version);
CREATE INDEX IF NOT EXISTS episodes_consumed ON episodes(consumed_step);
"""


class StoreError(RuntimeError):
    """The store cannot do what was asked (duplicate id, unknown episode, bad file)."""


class DuplicateEpisodeError(StoreError):
    """An episode with that id is already stored; storing it again can never succeed."""


def store_path(run_dir: str | Path) -> Path:
    """Where a run directory keeps its store."""
    return Path(run_dir) / STORE_FILENAME


class TrajectoryStore:
    """Episodes of one or more runs in one SQLite file. Thread-safe; one writer at a time.

    ``path`` is a file, a run directory (the store is ``trajectories.db`` inside), or
    ``":memory:"``.
    """

    def __init__(self, path: str | Path, *, run_id: str = "default") -> None:
        if str(path) != ":memory:":
            path = Path(path)
            if path.is_dir() or path.suffix == "":
                path.mkdir(parents=True, exist_ok=True)
                path = path / STORE_FILENAME
            path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.run_id = run_id
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:  # not SQLite, or another program's database
            raise StoreError(f"cannot open the trajectory store {path}: {exc}") from None

    @classmethod
    def open_existing(cls, path: str | Path) -> TrajectoryStore:
        """Open a store that must already exist (a run directory or its ``.db`` file), read-only.

        Creates nothing: a missing path or a file that is not a trajectory store raises
        ``StoreError`` saying which.
        """
        path = Path(path)
        db = path / STORE_FILENAME if path.is_dir() else path
        if not db.is_file():
            where = (
                f"{path} holds no {STORE_FILENAME}" if path.is_dir() else f"{path} does not exist"
            )
            raise StoreError(f"no trajectory store: {where}")
        store = cls.__new__(cls)
        store.path = db
        store.run_id = "default"
        store._lock = threading.Lock()
        try:
            store._db = sqlite3.connect(
                db.resolve().as_uri() + "?mode=ro",
                uri=True,
                check_same_thread=False,
                isolation_level=None,
            )
            store._db.execute("PRAGMA busy_timeout=30000")
            found = store._db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='episodes'"
            ).fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{db} is not a trajectory store ({exc})") from None
        if found is None:
            store._db.close()
            raise StoreError(f"{db} is not a trajectory store (it has no episodes table)")
        return store

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------

    def append(self, episode: Episode, *, run_id: str | None = None) -> None:
        """Store one episode durably. Returns once it is committed to disk."""
        self.append_many([episode], run_id=run_id)

    def append_many(self, episodes: Sequence[Episode], *, run_id: str | None = None) -> None:
        """Store several episodes in one transaction: all of them, or none."""
        run = run_id or self.run_id
        now = time.time()
        rows = [
            (
                ep.id,
                run,
                ep.task_id,
                ep.group_id,
                ep.status.value,
                ep.reward,
                ep.min_version,
                ep.max_version,
                ep.num_tokens,
                ep.started,
                ep.ended,
                now,
                ep.to_json(),
            )
            for ep in episodes
        ]
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany(
                    "INSERT INTO episodes (id, run_id, task_id, group_id, status, reward,"
                    " min_version, max_version, num_tokens, started, ended, stored, body)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    rows,
                )
                self._db.execute("COMMIT")
            except sqlite3.IntegrityError as exc:
                self._db.execute("ROLLBACK")
                raise DuplicateEpisodeError(f"episode id already stored: {exc}") from None
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def mark_consumed(self, episode_ids: Iterable[str], step: int) -> None:
        """Record that a training step used these episodes. An episode is consumed once."""
        ids = list(episode_ids)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                placeholders = ",".join("?" * len(ids))
                already = self._db.execute(
                    f"SELECT id, consumed_step FROM episodes WHERE id IN ({placeholders})"
                    " AND consumed_step IS NOT NULL",
                    ids,
                ).fetchall()
                found = self._db.execute(
                    f"SELECT COUNT(*) FROM episodes WHERE id IN ({placeholders})", ids
                ).fetchone()[0]
                if already:
                    raise StoreError(
                        "episodes already consumed: "
                        + ", ".join(f"{i} (step {s})" for i, s in already[:5])
                    )
                if found != len(set(ids)):
                    raise StoreError(f"{len(set(ids)) - found} of the episode ids are not stored")
                self._db.executemany(
                    "UPDATE episodes SET consumed_step=? WHERE id=?", [(step, i) for i in ids]
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def release_consumed_from(self, step: int) -> int:
        """Forget consumption by steps ``>= step`` (their updates were lost with a crash before
        the next checkpoint), so a resumed run trains those episodes again exactly once."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE episodes SET consumed_step=NULL WHERE consumed_step >= ?", (step,)
            )
            return cur.rowcount

    def relabel_run(self, run_id: str, new_run_id: str) -> int:
        """Move every episode of ``run_id`` to ``new_run_id`` (an evaluation cut short keeps
        its episodes apart from the one that replaces it); returns how many moved."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE episodes SET run_id=? WHERE run_id=?", (new_run_id, run_id)
            )
            return cur.rowcount

    # -- reading ---------------------------------------------------------------------------

    def _where(
        self,
        *,
        run_id: str | None = None,
        group_id: str | None = None,
        status: EpisodeStatus | str | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        consumed: bool | None = None,
        step: int | None = None,
    ) -> tuple[str, list[object]]:
        clauses: list[str] = []
        args: list[object] = []
        if run_id is not None:
            clauses.append("run_id = ?")
            args.append(run_id)
        if group_id is not None:
            clauses.append("group_id = ?")
            args.append(group_id)
        if status is not None:
            clauses.append("status = ?")
            args.append(EpisodeStatus(status).value)
        if min_version is not None:
            clauses.append("min_version >= ?")
            args.append(min_version)
        if max_version is not None:
            clauses.append("max_version <= ?")
            args.append(max_version)
        if consumed is True:
            clauses.append("consumed_step IS NOT NULL")
        elif consumed is False:
            clauses.append("consumed_step IS NULL")
        if step is not None:
            clauses.append("consumed_step = ?")
            args.append(step)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", args

    def query(
        self,
        *,
        run_id: str | None = None,
        group_id: str | None = None,
        status: EpisodeStatus | str | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        consumed: bool | None = None,
        step: int | None = None,
        limit: int | None = None,
    ) -> list[Episode]:
        """Episodes matching every given filter, oldest first.

        ``min_version``/``max_version`` bound the weight versions that sampled the episode's
        tokens (an episode with no turns has no version and matches neither bound).
        """
        return list(
            self.iter(
                run_id=run_id,
                group_id=group_id,
                status=status,
                min_version=min_version,
                max_version=max_version,
                consumed=consumed,
                step=step,
                limit=limit,
            )
        )

    def iter(self, *, limit: int | None = None, **filters: object) -> Iterator[Episode]:
        where, args = self._where(**filters)  # type: ignore[arg-type]
        sql = f"SELECT body FROM episodes{where} ORDER BY seq"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        for (body,) in rows:
            yield Episode.from_json(body)

    def get(self, episode_id: str) -> Episode:
        with self._lock:
            row = self._db.execute(
                "SELECT body FROM episodes WHERE id = ?", (episode_id,)
            ).fetchone()
        if row is None:
            raise StoreError(f"no episode {episode_id!r} in {self.path}")
        return Episode.from_json(row[0])

    def count(self, **filters: object) -> int:
        where, args = self._where(**filters)  # type: ignore[arg-type]
        with self._lock:
            return int(
                self._db.execute(f"SELECT COUNT(*) FROM episodes{where}", args).fetchone()[0]
            )

    def consumed_steps(self) -> dict[str, int]:
        """episode id -> the training step that consumed it."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, consumed_step FROM episodes WHERE consumed_step IS NOT NULL"
            ).fetchall()
        return dict(rows)

    def highest_version(self) -> int | None:
        """The newest weight version that sampled any stored token (None if none did)."""
        with self._lock:
            row = self._db.execute("SELECT MAX(max_version) FROM episodes").fetchone()
        return None if row[0] is None else int(row[0])

    def runs(self) -> list[str]:
        with self._lock:
            return [
                r[0]
                for r in self._db.execute("SELECT DISTINCT run_id FROM episodes ORDER BY run_id")
            ]

    # -- export ----------------------------------------------------------------------------

    def records(self, **filters: object) -> Iterator[dict[str, Any]]:
        """Matching episodes as plain dicts (the ``Episode`` JSON plus ``run_id`` and
        ``consumed_step``), oldest first."""
        where, args = self._where(**filters)  # type: ignore[arg-type]
        with self._lock:
            rows = self._db.execute(
                f"SELECT run_id, consumed_step, body FROM episodes{where} ORDER BY seq", args
            ).fetchall()
        for run_id, consumed_step, body in rows:
            record = json.loads(body)
            record["run_id"] = run_id
            record["consumed_step"] = consumed_step
            yield record

    def export_jsonl(self, out: IO[str], **filters: object) -> int:
        """Write one episode per line (the ``Episode`` JSON plus ``run_id``); returns the count."""
        n = 0
        for record in self.records(**filters):
            out.write(json.dumps(record) + "\n")
            n += 1
        return n
