"""fedlora's application layer: above the strategies (``strategies/``) and the clients (``clients/``).

The ServerApp (``server``), the run front-ends (``runner``: Flower's simulation engine on Ray or
the in-process engine), comparisons and tuning (``compare``, ``tune``), plots, the command line
(``cli``), the capability matrix and cross-silo deployment (``deploy``). Nothing below this
package imports it.
"""
