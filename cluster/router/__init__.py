"""The router: an aiohttp OpenAI-API front end that picks an engine per request by a named policy."""
