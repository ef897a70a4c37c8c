from hangdx.cli import main

raise SystemExit(main())
