"""Shared pytest configuration of the project's tests.

``proxy.pytest_plugin`` provides the ``context_proxy`` fixture (a proxy plus
the upstream emulator with the plugins a test passes), the same fixture plugin
authors use; loading it here tests it the way they load it.
"""

pytest_plugins = ["proxy.pytest_plugin"]
