from flowerbed.cli import main

raise SystemExit(main())
