from kvstrata.cli import main

raise SystemExit(main())
