from mixmoe.cli import main

raise SystemExit(main())
