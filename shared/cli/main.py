"""The ``crawlmesh`` command: one entry for the mesh, the services, crawls and schemas."""

from __future__ import annotations

from pathlib import Path

import typer

from shared.cli import deadletters, jobs, mesh, tenants

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="crawlmesh: a multi-tenant distributed crawler over NATS JetStream.")
app.command()(mesh.init)
app.command()(mesh.up)
app.command()(mesh.service)
app.command()(jobs.crawl)
app.command("submit")(jobs.submit_command)
app.command()(jobs.results)
app.command()(jobs.status)
app.command()(jobs.cancel)
app.add_typer(tenants.app, name="tenant")
app.add_typer(deadletters.app, name="dlq")


@app.command()
def schemas(root: Path = typer.Option(Path("."), help="Repository root holding proto/.")) -> None:
    """Regenerate proto/ (JSON Schemas and the AsyncAPI document) from the models."""
    from shared.schemas import write_proto

    for path in write_proto(root):
        typer.echo(path)


def main() -> None:
    """Run the CLI; a ``CRAWLMESH_*`` variable with a bad value is one clear line (exit 2),
    not a traceback."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from shared.settings import SettingsProblem, check_settings

    try:
        app()
    except (ValidationError, SettingsError, SettingsProblem):
        try:
            check_settings()
        except SettingsProblem as problem:
            typer.echo(f"crawlmesh: invalid setting: {problem}", err=True)
            raise SystemExit(2) from None
        raise


if __name__ == "__main__":
    main()
