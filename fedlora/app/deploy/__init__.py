"""Cross-silo deployment: certificates and keys (``certs``), a local SuperLink + SuperNodes (``local``).

``fedlora deploy certs DIR`` and ``fedlora deploy local CONFIG --nodes N`` are the command-line
entry points; README "Cross-silo deployment" shows the commands a real operator and each silo run.
"""

from fedlora.app.deploy.certs import CertPaths, write_certs, write_node_key
from fedlora.app.deploy.local import DeployError, LocalDeployment, deploy_local

__all__ = ["CertPaths", "DeployError", "LocalDeployment", "deploy_local", "write_certs", "write_node_key"]
