"""Makes the ``context_proxy`` fixture of context-proxy available to the tests."""

pytest_plugins = ["proxy.pytest_plugin"]
