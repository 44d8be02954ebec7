"""`python -m tests.fake_cli ARGS`: the evalkit CLI with the fake LM ("evalkit-fake") registered.

For subprocess tests and bench scripts: lm-eval's model registry lives in the
process, so a child process needs this launcher to see the fake LM. Run it from
the repo root (or with PYTHONPATH set to it).
"""

from tests.fake_lm import register_fake_lm

if __name__ == "__main__":
    from tests.children import die_with_parent

    die_with_parent()  # a test's child ends with the test run, even when pytest is stopped
    register_fake_lm()
    from evalkit.cli import main

    main()
