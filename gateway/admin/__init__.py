"""Administration: /admin/keys, usage, and the `switchyard keys` command."""
