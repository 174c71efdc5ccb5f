"""Models. Add yours here and give it a config under config/model/ (plus a schema in src/config.py)."""
