from flexgen_helm.cli import main

raise SystemExit(main())
