"""The Slack edge, one module per surface (commands, mentions, actions, shortcuts), wired in app.py."""
