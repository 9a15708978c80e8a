"""`agentr1 view`: a local, read-only web app over a data root's step tables (app.py)."""
