# tests/upstream holds a runner for torch's own test suites, not tests of this
# project: the project's pytest run collects nothing here.
collect_ignore_glob = ["*"]
