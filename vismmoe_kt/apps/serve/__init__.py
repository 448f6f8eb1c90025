"""`vismmoe-kt serve`: an OpenAI- and Ollama-compatible HTTP server over one loaded model.

Layout: `inputs` turns request bodies into prompts and images (with the limits and errors),
`engine` runs one generation at a time with a bounded wait queue and streams text (`batching`:
several at once), `app` maps the OpenAI endpoints onto them and `ollama` Ollama's, `errors` gives
every error the shape of its API, `guard` checks host, key, type and size before any route,
`access` logs one line per request, `metrics` is /metrics, `page.html` the web chat served at `/`;
`tools` checks a request's tools and renders them into the prompt, `tool_calls` reads the model's calls
back out of its text.
"""
