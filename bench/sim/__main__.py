from bench.sim.run import main

raise SystemExit(main())
