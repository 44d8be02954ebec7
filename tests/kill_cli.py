"""`python -m tests.kill_cli ARGS`: the evalkit CLI that kills itself at a chosen point of a run.

For the resume tests: a crash at an exact place, not a race. KILL_AT=N sends the process
KILL_SIG (default SIGKILL) once the run's journal holds N batches (0: only its header) and is
asked for a batch it does not hold (about to compute it) or given another to keep: exactly N
batches are in the journal, whatever the order in which the decoder finishes them; KILL_AT=store sends it when the finished
run is about to be written to the DB (every batch is in the journal); KILL_AT=prompts:N once the journal holds N
prompts or more, whole batches or not (the prompts journaled as their continuations end).
"""

import os
import signal

if __name__ == "__main__":
    from tests.children import die_with_parent

    die_with_parent()  # a test's child ends with the test run, even when pytest is stopped
    from evalkit.store import journal, runs

    at = os.environ["KILL_AT"]
    sig = getattr(signal, os.environ.get("KILL_SIG", "SIGKILL"))
    if at == "store":
        def finish_run(*args, **kwargs):
            os.kill(os.getpid(), sig)
            raise SystemExit("not killed")

        runs.finish_run = finish_run
    elif at.startswith("prompts:"):
        record_rows = journal.Journal.record_rows

        def killing_rows(self, finished):
            record_rows(self, finished)
            if self.prompts >= int(at.split(":")[1]):
                os.kill(os.getpid(), sig)
                import time

                time.sleep(30)

        journal.Journal.record_rows = killing_rows
    else:
        held, record = journal.Journal.held, journal.Journal.record

        def kill_past(self, parts):
            if len(self.batches) >= int(at) and journal.key_of(parts) not in self.batches:
                os.kill(os.getpid(), sig)
                import time

                time.sleep(30)  # a caught signal ends the process from its handler

        def killing_held(self, parts):
            kill_past(self, parts)
            return held(self, parts)

        def killing_record(self, parts, results):
            kill_past(self, parts)
            return record(self, parts, results)

        journal.Journal.held, journal.Journal.record = killing_held, killing_record
    from evalkit.cli import main

    main()
