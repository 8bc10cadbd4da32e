"""`python -m kda.bench`: time every available backend side by side, with FLA and FlashKDA as baselines.

Modules: `shapes` (what is measured), `timing` (how one call is timed), `runner` (the loop and the rows),
`results` (JSON, Markdown, chart, table), `cli` (the command line, including ``--tune`` and ``--jobs``),
`cold` (the fresh process that times a first call).
"""
