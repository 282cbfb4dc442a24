"""Seeder: validates seed submissions, creates jobs, emits depth-0 links."""
