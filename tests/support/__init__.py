"""Helpers the tests import (`from support import treeutil`, ...); tests/ is on sys.path
(pyproject's pytest `pythonpath`), so this package is `support`. Worker scripts that tests
run by path stay in tests/."""
