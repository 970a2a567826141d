"""Front ends: the library's ``generate()`` and its command line, the OpenAI-compatible server."""
