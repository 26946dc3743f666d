"""The `tigon` command: the platform's commands, then the runtime's (train, schema, demo-data).

    tigon render-job CONFIG --job-template NAME [--nodes N] [--namespace NS] [--triton-cache-claim NAME]
                     [--hf-cache-claim NAME] [--set key=value ...]
    tigon templates                      list the job templates ($TIGON_JOB_TEMPLATES, else deploy/job-templates,
                                         else the copy installed with tigon)
    tigon submit CONFIG --job-template NAME [--nodes N] [--steps N] [--set key=value ...] [--dry-run]
                                         check the run locally, then `pyflyte run --remote` the workflow
    tigon train CONFIG ...               see `tigon train --help`

`render-job` prints a ConfigMap and a PyTorchJob (kubectl-ready) from the same code path the
Flyte workflow uses; errors exit with status 2 before anything is printed.
"""

from __future__ import annotations

import argparse
import sys

from tigon.runtime import cli as runtime_cli

EXIT_ERROR = 2


def render_job(argv: list[str]) -> int:
    from tigon.platform.jobs import HF_CACHE_CLAIM, TRITON_CACHE_CLAIM, JobSpecError, pytorchjob_manifests, render_yaml
    from tigon.platform.submit import SubmissionError, add_run_arguments, check_submission
    from tigon.platform.templates import TemplateError, get_template
    from tigon.runtime.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="tigon render-job", description="print a PyTorchJob for a run config")
    add_run_arguments(parser, "YAML run config, e.g. examples/demo.yaml")
    parser.add_argument("--nodes", type=int, default=None, help="nodes for this run, up to the template's max_nnodes")
    parser.add_argument("--namespace", default=None, help="namespace for the objects")
    parser.add_argument(
        "--triton-cache-claim",
        default=TRITON_CACHE_CLAIM,
        help=f"the namespace's Triton cache claim to mount (default {TRITON_CACHE_CLAIM}, the chart's; '' for none)",
    )
    parser.add_argument(
        "--hf-cache-claim",
        default=HF_CACHE_CLAIM,
        help=f"the namespace's Hugging Face cache claim to mount (default {HF_CACHE_CLAIM}, the chart's; '' for none)",
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        template = check_submission(config, get_template(args.job_template), args.nodes or 0)
        manifests = pytorchjob_manifests(config, template, args.namespace, args.triton_cache_claim, args.hf_cache_claim)
    except (ConfigError, TemplateError, SubmissionError, JobSpecError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    sys.stdout.write(render_yaml(manifests))
    return 0


def list_templates() -> int:
    from tigon.platform.templates import TemplateError, load_templates

    try:
        templates = load_templates()
    except TemplateError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    for template in templates.values():
        gpus = f"{template.gpus_per_node} GPU" if template.gpus_per_node else "CPU"
        print(
            f"{template.name:12s} {template.nnodes} node(s) x {template.nproc_per_node} proc, {gpus}: "
            f"{template.description}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["render-job"]:
        return render_job(argv[1:])
    if argv[:1] == ["templates"]:
        return list_templates()
    if argv[:1] == ["submit"]:
        from tigon.platform.submit import submit

        return submit(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
    return runtime_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
