"""Cross-silo deployment: a local SuperLink + SuperNodes, certificates and keys, warm ClientApps.

One purpose per module: ``local`` runs ``fedlora deploy local`` (experiments on a fresh
federation, start to results), ``federation`` is the SuperLink / SuperNode side
(``LocalDeployment``), ``roles`` the three roles of a federation of separate hosts (``fedlora
deploy operator`` / ``silo`` / ``run``), ``kit`` their files (the federation, each silo's kit),
``preflight`` their checks (one line each), ``flwr_cli`` drives Flower's commands (command lines,
environment, log lines, ``flwr`` JSON replies), ``processes`` supervises processes, ``certs``
writes certificates and SuperNode keys, ``warm`` is fedlora's SuperExec for warm ClientApps.

``fedlora deploy certs | local | operator | silo | run`` are the command-line entry points;
docs/deployment.md shows the commands a real operator and each silo run.
"""

from fedlora.app.deploy.certs import CertPaths, write_certs, write_node_key
from fedlora.app.deploy.federation import LocalDeployment
from fedlora.app.deploy.flwr_cli import DeployError
from fedlora.app.deploy.local import deploy_local

__all__ = ["CertPaths", "DeployError", "LocalDeployment", "deploy_local", "write_certs", "write_node_key"]
