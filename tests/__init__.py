"""The test suite: a package, so that its modules import their shared helpers as `tests.helpers`."""
