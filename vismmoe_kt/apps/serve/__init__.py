"""`vismmoe-kt serve`: an OpenAI- and Ollama-compatible HTTP server over one loaded model.

Layout: `inputs` turns request bodies into prompts and images (with the limits and errors),
`engine` runs one generation at a time with a bounded wait queue and streams text, `app` maps the
endpoints onto them, `page.html` is the web chat served at `/`.
"""
