"""`python -m tests.kill_cli ARGS`: the evalkit CLI that kills itself at a chosen point of a run.

For the resume tests: a crash at an exact place, not a race. KILL_AT=N sends the process
KILL_SIG (default SIGKILL) when the run's journal is about to compute its batch N+1 (N
batches are in the journal, 0: only its header); KILL_AT=store sends it when the finished
run is about to be written to the DB (every batch is in the journal).
"""

import os
import signal

if __name__ == "__main__":
    from evalkit.store import journal, runs

    at = os.environ["KILL_AT"]
    sig = getattr(signal, os.environ.get("KILL_SIG", "SIGKILL"))
    if at == "store":
        def finish_run(*args, **kwargs):
            os.kill(os.getpid(), sig)
            raise SystemExit("not killed")

        runs.finish_run = finish_run
    else:
        batch = journal.Journal.batch

        def killing_batch(self, parts, compute):
            if len(self.batches) >= int(at) and journal.key_of(parts) not in self.batches:
                os.kill(os.getpid(), sig)
                import time

                time.sleep(30)  # a caught signal ends the process from its handler
            return batch(self, parts, compute)

        journal.Journal.batch = killing_batch
    from evalkit.cli import main

    main()
