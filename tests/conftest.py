"""Shared pytest setup: the plait.testing fixtures (fake_pg) for every test package."""

pytest_plugins = ["plait.testing.fixtures"]
