"""The append-only list of schema migrations of the evalkit DuckDB file.

Owns: the schema, as a list of named functions applied in order, each recorded
in `schema_version` inside the same transaction. Never edit or reorder an
applied migration; append a new one (to the newest `vNNN_MMM` module and its
`MIGRATIONS`). The functions live ten to a module by number. Does not:
open files or retry locks (that is `store.db.open_writer`).
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb

from evalkit.store.migrations import v001_010, v011_020, v021_030
from evalkit.store.migrations.v001_010 import APPLICATION_ID

Migration = Callable[[duckdb.DuckDBPyConnection], None]

__all__ = ["APPLICATION_ID", "MIGRATIONS", "Migration"]

# every migration in the order of application; each entry's place is its schema_version number
MIGRATIONS: list[Migration] = [*v001_010.MIGRATIONS, *v011_020.MIGRATIONS, *v021_030.MIGRATIONS]
